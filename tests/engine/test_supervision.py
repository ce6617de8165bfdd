"""Supervision: a dead worker fails in-flight requests; a killed engine leaves no process and no SHM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest

from fastdeploy_r3.cache_manager.shm import list_segments
from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.engine.engine_service import EngineService
from fastdeploy_r3.lifecycle import EngineDeadError
from fastdeploy_r3.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(fake_model_dir: Callable[..., str]) -> str:
    return fake_model_dir("mixtral")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_until(cond, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def test_killed_worker_fails_every_in_flight_request(model_dir: str) -> None:
    """Two requests decoding; SIGKILL the worker: the next step raises, both requests error, nothing leaks."""
    cfg = EngineConfig.from_kwargs(model_dir, block_size=4, num_gpu_blocks_override=32,
                                   routing_replay_config={"enable_routing_replay": True})
    engine = EngineService(cfg)
    suffix = engine.suffix
    try:
        engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        engine.add_request("b", [10, 11, 12], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(engine.workers.pids[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="worker rank 0"):
            for _ in range(100):
                engine.step()
        outs = {o.request_id: o.outputs[0] for o in engine.fail_all()}
        assert sorted(outs) == ["a", "b"]
        assert all(c.finish_reason == "error" and "worker rank 0" in c.error for c in outs.values())
        assert all(c.routed_experts is None for c in outs.values())
    finally:
        engine.shutdown()
    assert list_segments(suffix) == []


def _start_engine_script(model_dir: str, tmp_path) -> tuple[subprocess.Popen, str, int, int]:
    """An engine process with a worker and a CTM, R3 on, one request served; -> (proc, suffix, worker, CTM)."""
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from fastdeploy_r3 import LLM, SamplingParams
        llm = LLM({model_dir!r}, block_size=4, num_gpu_blocks_override=16, num_cpu_blocks_override=8,
                  routing_replay_config={{"enable_routing_replay": True}})
        llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=2), use_tqdm=False)
        eng = llm.engine
        print(eng.suffix, eng.workers.pids[0], eng.parts.resources.transfers.client.pid, flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    suffix, worker_pid, ctm_pid = proc.stdout.readline().split()
    return proc, suffix, int(worker_pid), int(ctm_pid)


def test_sigkilled_engine_leaves_no_children_and_no_shared_memory(model_dir: str, tmp_path) -> None:
    """An engine process with a worker and a CTM is SIGKILLed: its children notice and clean up."""
    proc, suffix, worker_pid, ctm_pid = _start_engine_script(model_dir, tmp_path)
    try:
        assert list_segments(suffix), "the engine should have SHM segments while alive"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert wait_until(lambda: not alive(worker_pid) and not alive(ctm_pid), 20)
        assert wait_until(lambda: list_segments(suffix) == [], 10), list_segments(suffix)
    finally:
        proc.kill()
        proc.wait()


def test_the_ctm_alone_unlinks_the_engines_segments_when_the_worker_cannot(model_dir: str, tmp_path) -> None:
    """The worker is stopped (SIGSTOP: it can run no cleanup, as if the OOM killer had taken it) when the
    engine is SIGKILLed: the CTM, seeing its engine gone, unlinks every segment of the engine, the worker's
    KV and the engine's routing buffer included, not only its own."""
    proc, suffix, worker_pid, ctm_pid = _start_engine_script(model_dir, tmp_path)
    try:
        os.kill(worker_pid, signal.SIGSTOP)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert wait_until(lambda: not alive(ctm_pid), 20)
        assert alive(worker_pid)  # stopped: none of the unlinking below is its doing
        assert wait_until(lambda: list_segments(suffix) == [], 10), list_segments(suffix)
    finally:
        os.kill(worker_pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
