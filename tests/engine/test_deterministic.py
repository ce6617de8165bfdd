"""Deterministic inference (--enable-deterministic-inference): one request gets bitwise the same tokens,
logprobs and R3 rows alone, inside batches of 1, 7, 32 and 63 random others, and as a prefix-cache hit.

Tiny qwen3_moe (float32 and bf16) and glm4_moe (float32) with real routing on the CPU, block_size 4, a
token budget of 96 so that in the larger batches the probe's 21-token prompt is chunked at other
boundaries than alone:

    probe: 21 prompt tokens, seeded sampling (temperature 1), 5 tokens with top-2 logprobs, R3 rows
    batch: the probe among N random prompts of 3..40 tokens with their own sampling params

With the mode off the same scenarios give other bits in float32 (the BLAS GEMMs are not batch-invariant
on this CPU: model_executor/batch_invariant.py), which is what makes the mode-on test a test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from batch_invariance_cases import BS, R3, differing, scenarios

from fastdeploy_r3 import LLM


@pytest.fixture(scope="module")
def engines(fake_model_dir: Callable[..., str]) -> Iterator[Callable[[str, str, bool], LLM]]:
    """engines(arch, dtype, deterministic) -> an LLM, built once for the module."""
    built: dict[tuple[str, str, bool], LLM] = {}

    def get(arch: str, dtype: str, deterministic: bool) -> LLM:
        if (arch, dtype, deterministic) not in built:
            built[arch, dtype, deterministic] = LLM(
                fake_model_dir(arch), dtype=dtype, block_size=BS, num_gpu_blocks_override=1024,
                max_num_seqs=64, max_num_batched_tokens=96, routing_replay_config=R3,
                enable_deterministic_inference=deterministic,
            )
        return built[arch, dtype, deterministic]

    yield get
    for llm in built.values():
        llm.shutdown()


@pytest.mark.parametrize(("arch", "dtype"), [("qwen3_moe", "float32"), ("qwen3_moe", "bfloat16"),
                                             ("glm4_moe", "float32")])  # fmt: skip
def test_deterministic_mode_is_batch_invariant(engines: Callable[[str, str, bool], LLM], arch: str,
                                               dtype: str) -> None:  # fmt: skip
    """Alone, in batches of 1, 7, 32 and 63, and from the prefix cache: the same bits. GLM adds the float32
    sigmoid router, shared experts, a dense layer and partial rotary (whose CPU sigmoid / cos, sin took
    another path for another batch size until they ran in fixed tiles)."""
    got = scenarios(engines(arch, dtype, True))
    assert differing(got) == []
    tokens, logprobs, rows = got["alone"]
    assert len(tokens) == 5 and len(logprobs) == 5
    assert len(rows) > 0


def test_default_kernels_are_not_batch_invariant_in_float32(engines: Callable[[str, str, bool], LLM]) -> None:
    """The same scenarios with the mode off: the float32 GEMMs reduce in another order for another number
    of rows, so the probe's logprobs (at least) change with the batch."""
    got = scenarios(engines("qwen3_moe", "float32", False))
    assert differing(got) != []
