"""Deterministic inference (--enable-deterministic-inference): one request gets bitwise the same tokens,
logprobs and R3 rows alone, inside batches of 1, 7, 32 and 63 random others, and as a prefix-cache hit.

Tiny qwen3_moe with real routing on the CPU, float32 and bf16, block_size 4, a token budget of 96 so
that in the larger batches the probe's 21-token prompt is chunked at other boundaries than alone:

    probe: 21 prompt tokens, seeded sampling (temperature 1), 5 tokens with top-2 logprobs, R3 rows
    batch: the probe among N random prompts of 3..40 tokens with their own sampling params

With the mode off the same scenarios give other bits in float32 (the BLAS GEMMs are not batch-invariant
on this CPU: model_executor/batch_invariant.py), which is what makes the mode-on test a test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.outputs import RequestOutput

BS = 4
BATCHES = (1, 7, 32, 63)
PROBE = SamplingParams(temperature=1.0, seed=7, max_tokens=5, logprobs=2, ignore_eos=True)
R3 = {"enable_routing_replay": True, "debug_mode": False}

_rng = np.random.default_rng(2024)
PROBE_PROMPT = [int(t) for t in _rng.integers(0, 500, 21)]
OTHERS = [[int(t) for t in _rng.integers(0, 500, int(n))] for n in _rng.integers(3, 41, max(BATCHES))]
OTHER_PARAMS = [
    SamplingParams(temperature=float(t), seed=int(s), max_tokens=int(m), ignore_eos=True)
    for t, s, m in zip(_rng.uniform(0.0, 1.5, max(BATCHES)), _rng.integers(0, 1000, max(BATCHES)),
                       _rng.integers(1, 7, max(BATCHES)), strict=True)
]  # fmt: skip

Fingerprint = tuple[list[int], list[tuple[float, tuple[tuple[int, float], ...]]], bytes]


def fingerprint(out: RequestOutput) -> Fingerprint:
    """The probe's tokens, logprobs (chosen and top-2, as floats: compared bit for bit) and R3 rows."""
    completion = out.outputs[0]
    assert completion.logprobs is not None and completion.routed_experts is not None
    logprobs = [(lp.logprob, tuple(lp.top)) for lp in completion.logprobs]
    return list(completion.token_ids), logprobs, completion.routed_experts.tobytes()


def in_batch(llm: LLM, num_others: int, cached_tokens: int = 0) -> Fingerprint:
    """The probe submitted in the middle of num_others random requests, all in one generate(); the prefix
    cache emptied first unless the probe is to hit `cached_tokens` of it."""
    if not cached_tokens:
        llm.engine.control.flush_cache()
    at = num_others // 2
    prompts = OTHERS[:at] + [PROBE_PROMPT] + OTHERS[at:num_others]
    params = OTHER_PARAMS[:at] + [PROBE] + OTHER_PARAMS[at:num_others]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[at].prompt_token_ids == PROBE_PROMPT
    assert outs[at].num_cached_tokens == cached_tokens
    return fingerprint(outs[at])


def scenarios(llm: LLM) -> dict[str, Fingerprint]:
    """The probe alone, in each batch (each time computed whole: the prefix cache emptied), and alone again
    right after itself (its prompt's 5 whole blocks a prefix-cache hit, the last token computed)."""
    got = {"alone": in_batch(llm, 0)}
    for n in BATCHES:
        got[f"with {n} others"] = in_batch(llm, n)
    got["prefix-cache hit"] = in_batch(llm, 0, cached_tokens=5 * BS)
    return got


def differing(got: dict[str, Fingerprint]) -> list[str]:
    return [name for name, fp in got.items() if fp != got["alone"]]


@pytest.fixture(scope="module")
def engines(fake_model_dir: Callable[..., str]) -> Iterator[Callable[[str, bool], LLM]]:
    """engines(dtype, deterministic) -> an LLM, built once for the module."""
    built: dict[tuple[str, bool], LLM] = {}

    def get(dtype: str, deterministic: bool) -> LLM:
        if (dtype, deterministic) not in built:
            built[dtype, deterministic] = LLM(
                fake_model_dir("qwen3_moe"), dtype=dtype, block_size=BS, num_gpu_blocks_override=1024,
                max_num_seqs=64, max_num_batched_tokens=96, routing_replay_config=R3,
                enable_deterministic_inference=deterministic,
            )
        return built[dtype, deterministic]

    yield get
    for llm in built.values():
        llm.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic_mode_is_batch_invariant(engines: Callable[[str, bool], LLM], dtype: str) -> None:
    """Alone, in batches of 1, 7, 32 and 63, and from the prefix cache: the same bits."""
    got = scenarios(engines(dtype, True))
    assert differing(got) == []
    tokens, logprobs, rows = got["alone"]
    assert len(tokens) == 5 and len(logprobs) == 5
    assert len(rows) > 0


def test_default_kernels_are_not_batch_invariant_in_float32(engines: Callable[[str, bool], LLM]) -> None:
    """The same scenarios with the mode off: the float32 GEMMs reduce in another order for another number
    of rows, so the probe's logprobs (at least) change with the batch."""
    got = scenarios(engines("float32", False))
    assert differing(got) != []
