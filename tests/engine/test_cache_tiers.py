"""Cache tiers end to end: greedy outputs are the same whether shared prefixes stay on the GPU,
go through the CPU tier and back, or come back from the storage tier (file and Redis); and a dead
cache transfer manager fails in-flight requests instead of hanging."""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable

import pytest

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.cache_manager.shm import list_segments
from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.engine.engine_service import EngineService
from fastdeploy_r3.lifecycle import EngineDeadError

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(fake_model_dir: Callable[..., str]) -> str:
    return fake_model_dir("qwen3_moe")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Three 24-token prefixes, each reused by four requests with different tails, interleaved."""
    rng = random.Random(7)
    bases = [[rng.randrange(3, 500) for _ in range(24)] for _ in range(3)]
    return [bases[i % 3] + [rng.randrange(3, 500) for _ in range(1 + i % 4)] for i in range(12)]


def generate(model_dir: str, prompts: list[list[int]], **kw: object) -> tuple[list[list[int]], dict]:
    r3 = {"enable_routing_replay": True}
    with LLM(model_dir, block_size=4, max_num_seqs=2, routing_replay_config=r3, **kw) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        metrics = llm.engine.metrics()
        llm.engine.kv.check_integrity()
    for o in outs:
        assert o.outputs[0].error is None, o.outputs[0].error
    return [o.outputs[0].token_ids for o in outs], metrics


@pytest.fixture(scope="module")
def reference(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    tokens, _ = generate(model_dir, prompts, num_gpu_blocks_override=256)
    return tokens


def test_cpu_tier_swaps_shared_prefixes_out_and_back(model_dir, prompts, reference) -> None:
    """16 GPU blocks hold two requests at a time: prefixes are evicted to the CPU tier and swapped back."""
    tokens, m = generate(model_dir, prompts, num_gpu_blocks_override=16, num_cpu_blocks_override=64)
    assert tokens == reference
    assert m["swap_out_blocks"] > 0 and m["swap_in_blocks"] > 0, m


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_storage_tier_without_cpu_tier(model_dir, prompts, reference, tmp_path, backend, request) -> None:
    """No CPU tier: evicted prefixes come back from storage; a second engine starts warm from the same store."""
    url = f"file://{tmp_path}/kv" if backend == "file" else request.getfixturevalue("redis_url").replace("/0", "/1")
    tokens, m = generate(model_dir, prompts, num_gpu_blocks_override=16, kv_storage=url)
    assert tokens == reference
    assert m["swap_out_blocks"] == 0 and m["storage_put_blocks"] > 0 and m["storage_load_blocks"] > 0, m
    tokens2, m2 = generate(model_dir, prompts[:3], num_gpu_blocks_override=64, kv_storage=url)
    assert tokens2 == reference[:3]
    assert m2["storage_load_blocks"] >= 3 * 6 - 3, m2  # each prompt's 6 full prefix blocks (one capped)


def test_killed_cache_transfer_manager_fails_in_flight_requests(model_dir, prompts) -> None:
    """SIGKILL the CTM mid-run: the next step raises EngineDeadError, every request errors, nothing leaks."""
    cfg = EngineConfig.from_kwargs(model_dir, block_size=4, num_gpu_blocks_override=24, num_cpu_blocks_override=32)
    engine = EngineService(cfg)
    suffix = engine.suffix
    try:
        for i, p in enumerate(prompts[:4]):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        engine.step()
        os.kill(engine._ctm.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="cache transfer manager"):
            for _ in range(200):
                engine.step()
        outs = engine.fail_all()
        assert sorted(o.request_id for o in outs) == ["r0", "r1", "r2", "r3"]
        for o in outs:
            assert o.finished and o.outputs[0].finish_reason == "error"
            assert "cache transfer manager" in o.outputs[0].error and o.outputs[0].routed_experts is None
        with pytest.raises(EngineDeadError):
            engine.add_request("late", prompts[0], GREEDY)
    finally:
        engine.shutdown()
    assert list_segments(suffix) == []
