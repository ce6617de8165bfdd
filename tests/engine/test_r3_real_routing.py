"""R3 with real routing: rows served from any KV tier are the rows recorded when that KV
was computed, bit for bit, and every row is the routing of the same tokens computed alone.

Tiny qwen3_moe, float32 on CPU, block_size 4, token-id prompts sharing a 6-block prefix:

    PREFIX (24 tokens = blocks 0..5) + 3-token suffix + 4 greedy tokens  ->  rows [24 + 3 + 4 - 1, L, K]

The "alone" reference is an engine with prefix caching off that runs one request at a time; where a
row differs from it, the router's K-th / (K+1)-th score gap of that token (from a direct forward of the
model) must be a near-tie.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from mooncake_server import flush_all, raw_client

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.blobstore.kv import namespace_prefix
from fastdeploy_r3.cache_manager.block_hash import hash_block_chain
from fastdeploy_r3.config import ModelConfig
from fastdeploy_r3.model_executor.forward_context import ForwardContext, set_forward_context
from fastdeploy_r3.model_executor.layers.moe import SparseMoeBlock, softmax_topk
from fastdeploy_r3.model_executor.model_loader import load_model
from fastdeploy_r3.outputs import RequestOutput

BS = 4
PREFIX_BLOCKS = 6
NEAR_TIE = 1e-4
MAX_MISMATCH_FRACTION = 0.01
GREEDY = SamplingParams(temperature=0, max_tokens=4)
R3 = {"enable_routing_replay": True, "debug_mode": False}

_rng = np.random.default_rng(1234)


def _ids(n: int) -> list[int]:
    return [int(t) for t in _rng.integers(0, 500, n)]  # below the special tokens (eos among them)


PREFIX = _ids(PREFIX_BLOCKS * BS)
PREFIX2 = _ids(PREFIX_BLOCKS * BS)
FILLERS = [_ids(PREFIX_BLOCKS * BS + 3) for _ in range(2)]


def _with(prefix: list[int], suffix: int) -> list[int]:
    return prefix + [suffix, suffix + 1, suffix + 2]


# -- the oracle: the same tokens alone, and the router's score gaps ----------------------------------------


class _RouterScores:
    """Direct forward of a whole sequence (no KV cache) with the router logits of every MoE layer."""

    def __init__(self, model_dir: str) -> None:
        cfg = ModelConfig(model_dir, dtype="float32")
        self.model = load_model(cfg, torch.device("cpu"))
        self.moe = sorted((m for m in self.model.modules() if isinstance(m, SparseMoeBlock)), key=lambda m: m.moe_index)

    def route(self, token_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(ids [T, L, K], gaps [T, L]) of every token: the router's top-k and the smallest gap between
        adjacent scores among its K + 1 best (the K-th vs (K+1)-th decides the set, the others the order)."""
        logits: dict[int, torch.Tensor] = {}
        hooks = [
            m.gate.register_forward_hook(lambda _mod, _inp, out, i=m.moe_index: logits.__setitem__(i, out.detach()))
            for m in self.moe
        ]
        try:
            with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=None, kv_caches=[])):
                self.model(torch.tensor(token_ids, dtype=torch.int64), torch.arange(len(token_ids)))
        finally:
            for h in hooks:
                h.remove()
        ids, gaps = [], []
        for m in self.moe:
            ids.append(softmax_topk(logits[m.moe_index], m.top_k, m.renormalize)[1].numpy())  # [T, K]
            top = torch.softmax(logits[m.moe_index].float(), dim=-1).topk(m.top_k + 1, dim=-1).values  # [T, K+1]
            gaps.append((top[:, :-1] - top[:, 1:]).min(dim=-1).values.numpy())  # [T]
        return np.stack(ids, axis=1), np.stack(gaps, axis=1)


class AloneOracle:
    """Rows of each prompt run alone in a fresh engine without prefix caching; gaps for any mismatch."""

    def __init__(self, model_dir: str) -> None:
        self.llm = LLM(model_dir, block_size=BS, num_gpu_blocks_override=32, enable_prefix_caching=False,
                       max_num_seqs=1, routing_replay_config=R3)
        self.model_dir = model_dir
        self._scores: _RouterScores | None = None
        self._cache: dict[tuple[int, ...], RequestOutput] = {}
        self.rows_checked = 0
        self.rows_mismatched = 0
        self.max_mismatch_gap = 0.0

    def run(self, prompt: list[int]) -> RequestOutput:
        key = tuple(prompt)
        if key not in self._cache:
            (self._cache[key],) = self.llm.generate([prompt], GREEDY, use_tqdm=False)
        return self._cache[key]

    def check(self, prompt: list[int], out: RequestOutput) -> None:
        """out's rows equal the alone run's, except rows whose differing layers are router near-ties."""
        ref = self.run(prompt).outputs[0]
        got = out.outputs[0]
        assert got.error is None, got.error
        assert got.token_ids == ref.token_ids, "greedy tokens differ from the alone run"
        assert got.routed_experts.shape == ref.routed_experts.shape
        differ = (got.routed_experts != ref.routed_experts).any(axis=2)  # [rows, L]
        self.rows_checked += len(differ)
        bad_rows = np.nonzero(differ.any(axis=1))[0]
        if len(bad_rows):
            if self._scores is None:
                self._scores = _RouterScores(self.model_dir)
            gaps = self._scores.route(prompt + ref.token_ids[:-1])[1][differ]  # gaps of the differing (row, layer)s
            self.rows_mismatched += len(bad_rows)
            self.max_mismatch_gap = max(self.max_mismatch_gap, float(gaps.max()))
            assert (gaps < NEAR_TIE).all(), f"rows {bad_rows.tolist()} differ from the alone run with gaps {gaps}"

    def report(self) -> str:
        return (f"R3 vs alone run: {self.rows_mismatched}/{self.rows_checked} rows differ, "
                f"max top-k gap among them {self.max_mismatch_gap:.3g}")


@pytest.fixture(scope="module")
def model_dir(fake_model_dir: Callable[..., str]) -> str:
    return fake_model_dir("qwen3_moe")


@pytest.fixture(scope="module")
def alone(model_dir: str) -> Iterator[AloneOracle]:
    oracle = AloneOracle(model_dir)
    yield oracle
    print("\n" + oracle.report())
    oracle.llm.shutdown()
    assert oracle.rows_mismatched <= MAX_MISMATCH_FRACTION * oracle.rows_checked, oracle.report()


def _one(llm: LLM, prompt: list[int]) -> RequestOutput:
    (out,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    return out


def _rows(out: RequestOutput) -> np.ndarray:
    assert out.outputs[0].error is None, out.outputs[0].error
    return out.outputs[0].routed_experts


def _prefix_hashes(llm: LLM, prefix: list[int]) -> list[bytes]:
    return hash_block_chain(llm.engine.kv.root_hash, prefix, BS, len(prefix) // BS)


def _counter_delta(llm: LLM, before: dict[str, float], *names: str) -> dict[str, float]:
    now = llm.engine.metrics()
    return {n: now[n] - before[n] for n in names}


P = PREFIX_BLOCKS * BS  # rows of the shared prefix


# -- GPU prefix hit, CPU tier, fail closed on a stale tag ----------------------------------------------------


@pytest.fixture(scope="module")
def tiered(model_dir: str) -> Iterator[LLM]:
    """10 GPU blocks (one 8-block request at a time) and a 16-block CPU tier."""
    llm = LLM(model_dir, block_size=BS, num_gpu_blocks_override=10, num_cpu_blocks_override=16,
              enable_prefix_caching=True, routing_replay_config=R3)
    yield llm
    llm.shutdown()


def test_gpu_hit_and_cpu_swap_in_serve_the_rows_recorded_at_compute(tiered: LLM, alone: AloneOracle) -> None:
    """A computes PREFIX; B hits it on GPU; fillers evict it to the CPU tier; C swaps it back in.
    B's and C's prefix rows are A's, bit for bit, and every row matches the alone run."""
    a_prompt, b_prompt, c_prompt = _with(PREFIX, 100), _with(PREFIX, 103), _with(PREFIX, 106)
    a = _one(tiered, a_prompt)
    rows_a = _rows(a)

    m0 = tiered.engine.metrics()
    b = _one(tiered, b_prompt)
    assert _counter_delta(tiered, m0, "prefix_hit_blocks", "swap_in_blocks") == {
        "prefix_hit_blocks": PREFIX_BLOCKS, "swap_in_blocks": 0}
    assert np.array_equal(_rows(b)[:P], rows_a[:P])

    for filler in FILLERS:
        _one(tiered, filler)
    hashes = _prefix_hashes(tiered, PREFIX)
    assert [tiered.engine.kv.gpu.cached_block(h) for h in hashes] == [None] * PREFIX_BLOCKS, "PREFIX is still on GPU"
    (cpu_tier,) = [c for c in tiered.engine.kv.connectors if c.name == "cpu"]
    assert all(cpu_tier.pool.cached_block(h) is not None for h in hashes), "PREFIX did not reach the CPU tier"

    m1 = tiered.engine.metrics()
    c = _one(tiered, c_prompt)
    assert _counter_delta(tiered, m1, "prefix_hit_blocks", "swap_in_blocks") == {
        "prefix_hit_blocks": 0, "swap_in_blocks": PREFIX_BLOCKS}
    assert np.array_equal(_rows(c)[:P], rows_a[:P])

    for prompt, out in ((a_prompt, a), (b_prompt, b), (c_prompt, c)):
        alone.check(prompt, out)
    assert tiered.engine.metrics()["r3_failures"] == 0


def test_stale_tag_on_a_cached_prefix_block_fails_closed(tiered: LLM, alone: AloneOracle) -> None:
    """PREFIX2's block 2 is cached on GPU; one of its rows gets another tag -> the request hitting it fails
    with RoutingReplayError naming the tag; the next request on PREFIX2 recomputes and is served correctly."""
    d_prompt, e_prompt = _with(PREFIX2, 100), _with(PREFIX2, 110)
    _one(tiered, d_prompt)
    block = tiered.engine.kv.gpu.cached_block(_prefix_hashes(tiered, PREFIX2)[2])
    assert block is not None
    slot = block.block_id * BS + 1  # row 9 of any request with PREFIX2
    tags = tiered.engine.parts.resources.routing_host.tags
    tags[slot] = block.routing_tag + 1000

    failures = tiered.engine.metrics()["r3_failures"]
    e = _one(tiered, e_prompt).outputs[0]
    assert (e.finish_reason, e.routed_experts) == ("error", None)
    assert "RoutingReplayError" in e.error
    assert "row 9 of request" in e.error and f"carries tag {block.routing_tag + 1000}" in e.error, e.error
    assert tiered.engine.metrics()["r3_failures"] == failures + 1

    # the failed request's blocks left the prefix cache: the next request on PREFIX2 recomputes them
    assert tiered.engine.kv.gpu.cached_block(_prefix_hashes(tiered, PREFIX2)[2]) is None
    g_prompt = _with(PREFIX2, 120)
    alone.check(g_prompt, _one(tiered, g_prompt))
    assert tiered.engine.metrics()["r3_failures"] == failures + 1

    f_prompt = FILLERS[0][:-3] + [7, 8, 9]
    alone.check(f_prompt, _one(tiered, f_prompt))


# -- storage tier: a second engine on the same store must load ------------------------------------------------


@pytest.fixture(params=["file", "redis", "mooncake"])
def storage_url(request: pytest.FixtureRequest, tmp_path: str) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/kv"
    if request.param == "mooncake":
        url = request.getfixturevalue("mooncake_store_url")
        flush_all(url)  # blocks of an earlier parametrization must not be found
        return url
    redis_url = request.getfixturevalue("redis_url")
    import redis

    redis.Redis.from_url(redis_url).flushdb()  # blocks of an earlier parametrization must not be found
    return redis_url


def _flip_stored_routing_byte(llm: LLM, url: str, key: str) -> None:
    """Flip one byte inside the routing rows of stored block `key`, just before the blob's 8-byte checksum."""
    if url.startswith("file://"):
        (path,) = glob.glob(os.path.join(url[len("file://"):], "**", key), recursive=True)
        blob = bytearray(open(path, "rb").read())
        blob[-8 - 5] ^= 0x01
        with open(path, "wb") as f:
            f.write(blob)
        return
    mc = llm.engine.config.model_config
    mooncake_key = f"fdr3:kv:{namespace_prefix(f'{mc.model_identity}|{mc.weight_version}')}:{key}"
    raw = raw_client(url.split("://", 1)[1].split("?", 1)[0])
    try:
        blob = bytearray(raw.get(mooncake_key))
        blob[-8 - 5] ^= 0x01  # the blob ends in its 8-byte checksum, as in a file
        assert raw.upsert(mooncake_key, bytes(blob)) == 0
    finally:
        raw.close()


def _storage_llm(model_dir: str, url: str) -> LLM:
    return LLM(model_dir, block_size=BS, num_gpu_blocks_override=16, kv_storage=url,
               enable_prefix_caching=True, routing_replay_config=R3)


def test_storage_load_serves_the_rows_recorded_by_the_writer(
    model_dir: str, storage_url: str, alone: AloneOracle
) -> None:
    """Engine 1 computes PREFIX and PREFIX2 (written through); engine 2 (no CPU tier) loads PREFIX for B:
    B's prefix rows are engine 1's, bit for bit. For file:// and mooncake://, one routing byte of PREFIX2's
    block 3 is flipped: engine 2 loads blocks 0..2, misses block 3, recomputes from there and still matches
    alone."""
    a_prompt, b_prompt = _with(PREFIX, 100), _with(PREFIX, 113)
    d_prompt, e_prompt = _with(PREFIX2, 100), _with(PREFIX2, 116)
    with _storage_llm(model_dir, storage_url) as writer:
        rows_a = _rows(_one(writer, a_prompt))
        _one(writer, d_prompt)
        hashes2 = _prefix_hashes(writer, PREFIX2)
    assert writer.engine.metrics()["storage_put_blocks"] >= 2 * PREFIX_BLOCKS

    with _storage_llm(model_dir, storage_url) as reader:
        assert reader.engine.num_cpu_blocks == 0
        m0 = reader.engine.metrics()
        b = _one(reader, b_prompt)
        assert _counter_delta(reader, m0, "prefix_hit_blocks", "storage_load_blocks") == {
            "prefix_hit_blocks": 0, "storage_load_blocks": PREFIX_BLOCKS}
        assert np.array_equal(_rows(b)[:P], rows_a[:P])
        alone.check(b_prompt, b)

        if not storage_url.startswith("redis://"):
            _flip_stored_routing_byte(reader, storage_url, hashes2[3].hex())
            m1 = reader.engine.metrics()
            e = _one(reader, e_prompt)
            # blocks 4, 5 arrive in the same task but are dropped after block 3's miss: the hit is 3 blocks
            assert _counter_delta(reader, m1, "storage_load_failed_blocks")["storage_load_failed_blocks"] == 1
            assert e.num_cached_tokens == 3 * BS
            alone.check(e_prompt, e)
        assert reader.engine.metrics()["r3_failures"] == 0


# -- everything at once: concurrent shared prefixes, chunked prefill, preemption ------------------------------


def test_concurrent_shared_prefixes_with_chunked_prefill_and_preemption_match_alone(
    model_dir: str, alone: AloneOracle
) -> None:
    """Six prompts over two shared prefixes in one batch, a 10-token budget (chunked prefill) and 14 GPU
    blocks (preemption): every request's rows equal the alone run's, near-ties aside."""
    prompts = [_with(PREFIX if i % 2 else PREFIX2, 300 + 3 * i) for i in range(6)]
    with LLM(model_dir, block_size=BS, num_gpu_blocks_override=14, enable_prefix_caching=True,
             enable_chunked_prefill=True, max_num_batched_tokens=10, routing_replay_config=R3) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        m = llm.engine.metrics()
    assert m["prefix_hit_blocks"] > 0 and m["preemptions"] > 0 and m["r3_failures"] == 0, m
    for prompt, out in zip(prompts, outs):
        alone.check(prompt, out)


def test_alone_run_equals_a_plain_forward_except_near_ties(model_dir: str, alone: AloneOracle) -> None:
    """The reference itself: the alone engine's rows (paged KV, prefill + decode steps) equal the top-k of one
    plain forward of the same tokens, except near-ties; the smallest router gap seen is reported."""
    scores = _RouterScores(model_dir)
    n_rows = n_differ = 0
    min_gap, max_differ_gap = np.inf, 0.0
    for prompt in (_with(PREFIX, 100), _with(PREFIX2, 100), *FILLERS):
        ref = alone.run(prompt).outputs[0]
        ids, gaps = scores.route(prompt + ref.token_ids[:-1])
        assert ids.shape == ref.routed_experts.shape
        differ = (ids != ref.routed_experts).any(axis=2)  # [rows, L]
        assert (gaps[differ] < NEAR_TIE).all(), f"non-tie mismatches with gaps {gaps[differ]}"
        n_rows, n_differ = n_rows + len(ids), n_differ + int(differ.any(axis=1).sum())
        min_gap = min(min_gap, float(gaps.min()))
        max_differ_gap = max([max_differ_gap, *gaps[differ].tolist()])
    print(f"\nalone engine vs plain forward: {n_differ}/{n_rows} rows differ (max gap {max_differ_gap:.3g}); "
          f"smallest router gap over all rows {min_gap:.3g}")
    assert n_differ <= MAX_MISMATCH_FRACTION * n_rows
