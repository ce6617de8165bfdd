"""Engine-level scenarios through the offline API: greedy outputs are the same whatever path the KV
cache took (prefix hits, chunked prefill, preemption), R3 has the promised shape and positions, the
engine leaks nothing, and bad input fails with a typed error that names the problem.

Tiny fake Qwen3-MoE: 4 MoE layers, 16 experts, top-4, vocab 512 (509..511 special), block_size 4.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from collections.abc import Iterator

import numpy as np
import pytest

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.config import ConfigError
from fastdeploy_r3.outputs import OutputAssembler, RequestOutput
from fastdeploy_r3.sampling_params import InvalidRequestError

BLOCK = 4
MAX_TOKENS = 6
R3 = {"enable_routing_replay": True}
R3_DEBUG = {"enable_routing_replay": True, "debug_mode": True}
# no chunked prefill needs max_num_batched_tokens >= max_model_len
UNCHUNKED = {"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_model_len": 64}

_SHARED = list(range(10, 26))  # 16 tokens = 4 full blocks
PROMPTS: list[list[int]] = [
    _SHARED + [100, 101, 102],  # 19
    _SHARED + [200, 201],  # 18: shares 4 blocks with #0
    _SHARED[:8] + [300, 301, 302, 303, 304],  # 13: shares 2 blocks
    [7, 8, 9],  # 3
    list(range(400, 411)),  # 11
    _SHARED + [100, 101, 102, 103, 104, 105],  # 22: extends #0
    [42],  # 1
    list(_SHARED),  # 16: all 4 blocks cached after #0, but its last token must still be computed
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def token_ids(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_same_as(outs: list[RequestOutput], want: list[RequestOutput]) -> None:
    """Same tokens, and (real routing, float32 on CPU) the same R3 rows bit for bit."""
    assert token_ids(outs) == token_ids(want)
    for got, ref in zip(outs, want, strict=True):
        np.testing.assert_array_equal(got.outputs[0].routed_experts, ref.outputs[0].routed_experts)


def assert_rows_are_positions(out: RequestOutput) -> None:
    """Debug mode: row i of a completion holds position start + i in every layer and slot."""
    for comp in out.outputs:
        end = len(out.prompt_token_ids) + len(comp.token_ids) - 1
        want = np.arange(comp.routed_experts_start, end) % 255
        rows = comp.routed_experts
        assert rows is not None, comp.error
        assert rows.shape[0] == end - comp.routed_experts_start
        assert (rows == want[:, None, None].astype(np.uint8)).all(), f"{out.request_id}: {rows[:, 0, 0]}"


def shm_segments(suffix: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"fdr3_{suffix}_")]


@pytest.fixture(scope="module")
def baseline(qwen3_dir: str) -> Iterator[LLM]:
    """The plain path: big cache, no prefix caching, whole prompts in one step, real R3."""
    with LLM(qwen3_dir, block_size=BLOCK, num_gpu_blocks_override=128, enable_prefix_caching=False,
             routing_replay_config=R3, **UNCHUNKED) as llm:
        yield llm


@pytest.fixture(scope="module")
def baseline_outs(baseline: LLM) -> list[RequestOutput]:
    return baseline.generate(PROMPTS, GREEDY, use_tqdm=False)


# -- 1. greedy outputs do not depend on the KV path ------------------------------------------------


def test_prefix_caching_on_matches_off(qwen3_dir: str, baseline_outs: list[RequestOutput]) -> None:
    """Prefix caching on: #0 alone first, then all; the repeat of #0 hits and every token and R3 row matches."""
    with LLM(qwen3_dir, block_size=BLOCK, num_gpu_blocks_override=128, enable_prefix_caching=True,
             routing_replay_config=R3, **UNCHUNKED) as llm:
        first = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert first[0].num_cached_tokens == 0
        assert outs[0].num_cached_tokens == 16  # 4 full blocks; the 19th token is recomputed
        assert outs[7].num_cached_tokens == 12  # the whole prompt is cached; its last block is recomputed
        assert llm.engine.metrics()["prefix_hit_blocks"] >= 4
    assert token_ids(first) == token_ids(baseline_outs[:1])
    assert_same_as(outs, baseline_outs)


def test_chunked_prefill_matches_whole_prefill(qwen3_dir: str, baseline_outs: list[RequestOutput]) -> None:
    """Chunked prefill with an 8-token budget: prompts are cut in chunks, tokens and R3 rows match."""
    with LLM(qwen3_dir, block_size=BLOCK, num_gpu_blocks_override=128, enable_prefix_caching=False,
             enable_chunked_prefill=True, max_num_batched_tokens=8, max_model_len=64,
             routing_replay_config=R3) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same_as(outs, baseline_outs)


def test_preemption_matches_big_cache(qwen3_dir: str, baseline_outs: list[RequestOutput]) -> None:
    """9 blocks, longest request needs 7: seven requests preempt each other and recompute, same tokens."""
    with LLM(qwen3_dir, block_size=BLOCK, num_gpu_blocks_override=9, max_num_seqs=8, enable_prefix_caching=False,
             routing_replay_config=R3, **UNCHUNKED) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.engine.metrics()["preemptions"] > 0
    assert_same_as(outs, baseline_outs)


# -- 2. R3 shape and positions ---------------------------------------------------------------------


def test_r3_shape_dtype_and_layer_ids(baseline_outs: list[RequestOutput]) -> None:
    """Each completion carries [P + N - 1, L=4, K=4] uint8 expert ids < 16 and the MoE layer ids."""
    for prompt, out in zip(PROMPTS, baseline_outs, strict=True):
        comp = out.outputs[0]
        assert comp.finish_reason == "length" and len(comp.token_ids) == MAX_TOKENS
        assert out.moe_layer_ids == [0, 1, 2, 3]
        assert comp.routed_experts_start == 0
        assert comp.routed_experts.shape == (len(prompt) + MAX_TOKENS - 1, 4, 4)
        assert comp.routed_experts.dtype == np.uint8
        assert comp.routed_experts.max() < 16
        # top-k picks K distinct experts per token and layer
        assert all(len(set(row)) == 4 for row in comp.routed_experts.reshape(-1, 4).tolist())


def test_r3_routed_experts_start(baseline: LLM, baseline_outs: list[RequestOutput]) -> None:
    """routed_experts_start=5 returns rows [5, P + N - 1): the tail of the full array."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, routed_experts_start=5)
    (out,) = baseline.generate([PROMPTS[0]], params, use_tqdm=False)
    comp = out.outputs[0]
    assert comp.routed_experts_start == 5
    assert comp.routed_experts.shape == (19 + MAX_TOKENS - 1 - 5, 4, 4)
    np.testing.assert_array_equal(comp.routed_experts, baseline_outs[0].outputs[0].routed_experts[5:])


def test_r3_per_choice_and_opt_out(baseline: LLM) -> None:
    """n=2: each choice carries its own rows, equal on the prompt; return_routed_experts=False: none."""
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = baseline.generate([PROMPTS[4]], params, use_tqdm=False)
    a, b = (c.routed_experts for c in out.outputs)
    assert a.shape == b.shape == (11 + MAX_TOKENS - 1, 4, 4)
    np.testing.assert_array_equal(a[:11], b[:11])  # rows of the prompt tokens (row i routes token i)
    (out,) = baseline.generate([PROMPTS[4]], SamplingParams(max_tokens=2, return_routed_experts=False),
                               use_tqdm=False)
    assert out.outputs[0].routed_experts is None and out.outputs[0].error is None


def test_generation_stops_at_max_model_len(baseline: LLM) -> None:
    """A 61-token prompt with max_model_len 64 and max_tokens 6: 3 tokens, finish 'length', 63 rows."""
    (out,) = baseline.generate([list(range(100, 161))], GREEDY, use_tqdm=False)
    comp = out.outputs[0]
    assert len(comp.token_ids) == 3 and comp.finish_reason == "length"
    assert comp.routed_experts.shape == (63, 4, 4)


def test_max_model_len_follows_a_cache_too_small_for_it(qwen3_dir: str) -> None:
    """8 blocks of 4 tokens hold 32 tokens: max_model_len 512 becomes 32, and a 30-token prompt asking
    for 100 tokens ends at 32 with 'length' and 31 rows instead of being refused."""
    with LLM(qwen3_dir, block_size=BLOCK, num_gpu_blocks_override=8, routing_replay_config=R3) as llm:
        assert (llm.engine.max_model_len, llm.engine.config.max_model_len) == (32, 512)  # in force, asked
        (out,) = llm.generate([list(range(100, 130))], SamplingParams(max_tokens=100, ignore_eos=True),
                              use_tqdm=False)
    comp = out.outputs[0]
    assert (len(comp.token_ids), comp.finish_reason) == (2, "length")
    assert comp.routed_experts.shape == (31, 4, 4)


def test_r3_debug_rows_are_positions_across_hits_chunks_and_preemption(
    qwen3_dir: str, baseline_outs: list[RequestOutput]
) -> None:
    """Debug mode, prefix caching + 8-token chunks + 9 blocks in one run: every row equals its position."""
    with LLM(qwen3_dir, block_size=BLOCK, num_gpu_blocks_override=9, max_num_seqs=8, enable_prefix_caching=True,
             enable_chunked_prefill=True, max_num_batched_tokens=8, max_model_len=64,
             routing_replay_config=R3_DEBUG) as llm:
        first = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        params = [GREEDY] * len(PROMPTS)
        params[3] = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, routed_experts_start=2)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        m = llm.engine.metrics()
    assert m["prefix_hit_blocks"] > 0 and outs[0].num_cached_tokens > 0
    assert m["preemptions"] > 0
    assert m["r3_failures"] == 0
    assert token_ids(first) == token_ids(baseline_outs[:1])
    assert token_ids(outs) == token_ids(baseline_outs)
    for out in first + outs:
        assert_rows_are_positions(out)
    late = outs[3].outputs[0]  # 3-token prompt + 6 tokens = rows 0..7, from 2 on
    assert late.routed_experts_start == 2 and late.routed_experts.shape == (6, 4, 4)


# -- 3. no leaks -----------------------------------------------------------------------------------


def _assert_gone(pids: list[int], suffix: str) -> None:
    # other engines of this module may be alive: only this engine's workers must be gone
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("fdr3-worker") and p.pid in pids]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert shm_segments(suffix) == []


def test_shutdown_leaves_no_worker_and_no_shm(qwen3_dir: str) -> None:
    """After shutdown(): the worker pids are gone and no /dev/shm/fdr3_<suffix>_* remains."""
    llm = LLM(qwen3_dir, block_size=BLOCK, num_gpu_blocks_override=16, routing_replay_config=R3)
    llm.generate([PROMPTS[3]], GREEDY, use_tqdm=False)
    pids = llm.engine.workers.pids
    suffix = llm.engine.suffix
    assert pids and shm_segments(suffix)  # the check below would be vacuous otherwise
    llm.shutdown()
    _assert_gone(pids, suffix)
    llm.shutdown()  # idempotent


def test_with_block_leaves_no_worker_and_no_shm(qwen3_dir: str) -> None:
    """Leaving `with LLM(...)` by an exception shuts the engine down just the same."""
    with pytest.raises(RuntimeError, match="leave"):
        with LLM(qwen3_dir, block_size=BLOCK, num_gpu_blocks_override=16, routing_replay_config=R3) as llm:
            pids = llm.engine.workers.pids
            suffix = llm.engine.suffix
            assert shm_segments(suffix)
            raise RuntimeError("leave the block")
    _assert_gone(pids, suffix)


# -- 4. bad input ----------------------------------------------------------------------------------


def _copy_model(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _edit_config(model: str, **changes: object) -> None:
    path = os.path.join(model, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


def test_missing_model_dir(tmp_path) -> None:
    """A directory that does not exist is named in the error."""
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_dir_without_config_json(tmp_path) -> None:
    """An empty directory: no config.json."""
    with pytest.raises(ConfigError, match="no config.json"):
        LLM(str(tmp_path))


def test_malformed_config_json(tmp_path, qwen3_dir: str) -> None:
    """config.json that is not JSON."""
    model = _copy_model(qwen3_dir, str(tmp_path / "m"))
    with open(os.path.join(model, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        LLM(model)


def test_unknown_architecture(tmp_path, qwen3_dir: str) -> None:
    """An architecture the engine has no model for is named."""
    model = _copy_model(qwen3_dir, str(tmp_path / "m"))
    _edit_config(model, architectures=["LlamaForCausalLM"])
    with pytest.raises(ConfigError, match="unknown architecture 'LlamaForCausalLM'"):
        LLM(model)


def test_non_moe_config(tmp_path, qwen3_dir: str) -> None:
    """A Qwen3-MoE config with num_experts 0 is not a MoE model."""
    model = _copy_model(qwen3_dir, str(tmp_path / "m"))
    _edit_config(model, num_experts=0)
    with pytest.raises(ConfigError, match="not a MoE model"):
        LLM(model)


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (list(range(64)), "max_model_len is 64"),
        ([], "empty"),
        ([1, 2, 512], "token id 512 is outside the vocabulary"),
        ([1, -1], "token id -1 is outside the vocabulary"),
        ("", "empty"),
    ],
    ids=["too-long", "empty-ids", "id-too-big", "id-negative", "empty-text"],
)
def test_bad_prompt_then_engine_still_serves(
    baseline: LLM, baseline_outs: list[RequestOutput], prompt: list[int] | str, match: str
) -> None:
    """A bad prompt raises InvalidRequestError; the same engine then serves a normal request unchanged."""
    with pytest.raises(InvalidRequestError, match=match):
        baseline.generate([PROMPTS[3], prompt], GREEDY, use_tqdm=False)
    assert not baseline.engine.has_unfinished_requests()
    (out,) = baseline.generate([PROMPTS[3]], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == baseline_outs[3].outputs[0].token_ids


def test_max_tokens_zero_then_engine_still_serves(baseline: LLM, baseline_outs: list[RequestOutput]) -> None:
    """max_tokens=0 is refused with a message naming it; the engine is unaffected."""
    with pytest.raises(InvalidRequestError, match="max_tokens=0"):
        baseline.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=0), use_tqdm=False)
    (out,) = baseline.generate([PROMPTS[3]], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == baseline_outs[3].outputs[0].token_ids


# -- 6. the other families -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "moe_layer_ids"),
    [("mixtral", [0, 1, 2, 3]), ("glm4_moe", [1, 2, 3])],  # GLM's layer 0 is dense (first_k_dense_replace=1)
)
def test_other_families_generate_with_r3(fake_model_dir, family: str, moe_layer_ids: list[int]) -> None:
    """Mixtral and GLM-4.5: a short greedy text generation with R3 on returns [P + N - 1, L, K=4] uint8 rows."""
    model = fake_model_dir(family)
    with LLM(model, block_size=BLOCK, num_gpu_blocks_override=32, routing_replay_config=R3) as llm:
        outs = llm.generate(["Hello world!", "The capital of France is"], GREEDY, use_tqdm=False)
    for out in outs:
        comp = out.outputs[0]
        assert len(comp.token_ids) == MAX_TOKENS and comp.finish_reason == "length"
        assert isinstance(comp.text, str)
        assert out.moe_layer_ids == moe_layer_ids
        assert comp.routed_experts.shape == (len(out.prompt_token_ids) + MAX_TOKENS - 1, len(moe_layer_ids), 4)
        assert comp.routed_experts.dtype == np.uint8 and comp.routed_experts.max() < 16


def test_request_ids_in_flight_are_unique_across_choices(baseline: LLM) -> None:
    """'x' with n=2 runs as choices 'x#0' and 'x#1': a second 'x' or an 'x#1' is refused, then 'x' finishes."""
    eng = baseline.engine
    eng.add_request("x", [5, 6, 7], SamplingParams(n=2, max_tokens=2, seed=1))
    for dup in ("x", "x#1"):
        with pytest.raises(InvalidRequestError, match="already in flight"):
            eng.add_request(dup, [5, 6, 7], SamplingParams(max_tokens=2))
    assembler = OutputAssembler("x")
    done = []
    while eng.has_unfinished_requests():
        for delta in eng.step():
            assembler.add(delta)
            done += [delta.request_id] if delta.finished else []
    assert done == ["x"] and [c.index for c in assembler.output().outputs] == [0, 1]

