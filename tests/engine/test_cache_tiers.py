"""Cache tiers end to end: greedy outputs are the same whether shared prefixes stay on the GPU,
go through the CPU tier and back, or come back from the storage tier (file, Redis, Mooncake); and a dead
cache transfer manager is replaced without costing a request."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable

import pytest
from mooncake_server import flush_all, mooncake_master, mooncake_url

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.cache_manager.shm import list_segments
from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.engine.engine_service import EngineService

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
        llm.engine.kv.poll_transfers(block=True)  # write-through still in flight counts once acknowledged
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


@pytest.mark.parametrize("backend", ["file", "redis", "mooncake"])
def test_storage_tier_without_cpu_tier(model_dir, prompts, reference, tmp_path, backend, request) -> None:
    """No CPU tier: evicted prefixes come back from storage; a second engine starts warm from the same store."""
    if backend == "file":
        url = f"file://{tmp_path}/kv"
    elif backend == "redis":
        url = request.getfixturevalue("redis_url").replace("/0", "/1")
    else:
        url = request.getfixturevalue("mooncake_store_url")
        flush_all(url)  # blocks another test stored for this model must not be found
    tokens, m = generate(model_dir, prompts, num_gpu_blocks_override=16, kv_storage=url)
    assert tokens == reference
    assert m["swap_out_blocks"] == 0 and m["storage_put_blocks"] > 0 and m["storage_load_blocks"] > 0, m
    tokens2, m2 = generate(model_dir, prompts[:3], num_gpu_blocks_override=64, kv_storage=url)
    assert tokens2 == reference[:3]
    assert m2["storage_load_blocks"] >= 3 * 6 - 3, m2  # each prompt's 6 full prefix blocks (one capped)


def test_the_engines_store_connections_are_closed_at_shutdown(model_dir, prompts, redis_url) -> None:
    """Redis db 7 is this test's alone: while the engine runs, its lookup connection and the CTM's are
    there; once it has shut down, none is left (the engine's own used to stay open until exit)."""
    import redis

    observer = redis.Redis.from_url(redis_url)  # db 0: not counted

    def clients() -> int:
        return sum(1 for c in observer.client_list() if str(c.get("db")) == "7")

    with LLM(model_dir, block_size=4, num_gpu_blocks_override=16, kv_storage=redis_url.replace("/0", "/7")) as llm:
        llm.generate(prompts[:2], GREEDY, use_tqdm=False)
        assert clients() >= 2
    for _ in range(100):  # the CTM's socket goes with its process; the server sees it a moment later
        if clients() == 0:
            break
        time.sleep(0.05)
    assert clients() == 0, observer.client_list()
    observer.close()


def test_mooncake_blocks_of_an_exited_engine_are_recomputed(model_dir, prompts, reference) -> None:
    """No holder: the engine's own segments keep its blocks, so once it exits a second engine on the same
    master finds none of them (no load, no stale data) and recomputes the same greedy tokens."""
    with mooncake_master() as master:
        url = mooncake_url(master, segment="64MB")
        tokens, m = generate(model_dir, prompts, num_gpu_blocks_override=16, kv_storage=url)
        assert tokens == reference and m["storage_put_blocks"] > 0, m
        tokens2, m2 = generate(model_dir, prompts[:3], num_gpu_blocks_override=64, kv_storage=url)
        assert tokens2 == reference[:3]
        assert m2["storage_load_blocks"] == 0 and m2["storage_put_blocks"] > 0, m2


def _run_to_end(engine: EngineService, n: int, tokens: dict[str, list[int]] | None = None,
                max_steps: int = 2000) -> dict[str, list[int]]:  # fmt: skip
    """Step until n requests finished (or max_steps); their tokens, gathered from the deltas into `tokens`."""
    done: dict[str, list[int]] = {}
    tokens = {} if tokens is None else tokens
    for _ in range(max_steps):
        for out in engine.step():
            for c in out.outputs:
                tokens.setdefault(out.request_id, []).extend(c.token_ids)
                assert c.error is None, c.error
            if out.finished:
                done[out.request_id] = tokens[out.request_id]
        if len(done) == n:
            return done
    if max_steps < 2000:
        return done
    raise AssertionError(f"only {sorted(done)} finished")


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_lost_cache_transfer_manager_is_replaced_and_costs_no_request(model_dir, prompts, reference, fault) -> None:
    """SIGKILL (or SIGSTOP: past transfer_timeout_s it is stuck) the CTM mid-run: it is killed and
    replaced, its CPU tier becomes misses, and every request finishes with the tokens of a run
    without tiers; nothing leaks."""
    cfg = EngineConfig.from_kwargs(model_dir, block_size=4, num_gpu_blocks_override=24, num_cpu_blocks_override=32,
                                   max_num_seqs=2, transfer_timeout_s=2.0,
                                   routing_replay_config={"enable_routing_replay": True, "debug_mode": True})
    engine = EngineService(cfg)
    suffix = engine.suffix
    try:
        for i, p in enumerate(prompts[:6]):
            engine.add_request(f"r{i}", p, GREEDY)
        tokens: dict[str, list[int]] = {}
        _run_to_end(engine, 6, tokens, max_steps=3)
        old = engine.parts.resources.transfers.client.pid
        os.kill(old, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        done = _run_to_end(engine, 6, tokens)
        assert [done[f"r{i}"] for i in range(6)] == reference[:6]
        for _ in range(600):  # the replacement comes up while requests keep going
            if engine.parts.resources.transfers.client is not None:
                break
            engine.step()
            time.sleep(0.05)
        client = engine.parts.resources.transfers.client
        assert client is not None and client.pid != old
        assert engine.metrics()["cache_transfer_replacements"] == 1
        engine.add_request("late", prompts[0], GREEDY)
        assert _run_to_end(engine, 1)["late"] == reference[0]
    finally:
        engine.shutdown()
        if fault == "stop":
            os.kill(old, signal.SIGKILL) if os.path.exists(f"/proc/{old}") else None
    assert list_segments(suffix) == []
