"""For the expert-parallel engine tests (tests/worker/test_expert_parallel_ep4.py): five prompts that hit
cached prefixes, preempt and swap on an 8-block cache, one engine run of them, and the comparison of an
expert-parallel run with EP=1's.

The checkpoints are transformers-written (tests/hf_checkpoints.py) with 4 kv heads (not _COMMON's 2) so
that four ranks split them: 4 heads, 4 kv heads, head_dim 8, hidden 32; qwen3_moe and mixtral 8 experts
top-2, glm4_moe 16 experts top-4.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pytest
from hf_checkpoints import MOE_LAYER_IDS, write_hf_checkpoint

from fastdeploy_r3 import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
R3 = {"enable_routing_replay": True}
NUM_EXPERTS = {"qwen3_moe": 8, "mixtral": 8, "glm4_moe": 16}


def _prompts() -> list[list[int]]:
    """Two 8-token prefixes (2 blocks of 4), each reused by later requests with different tails: prefix hits.
    Three at a time in 8 blocks: the last ones wait, preempt and swap."""
    rng = random.Random(7)
    bases = [[rng.randrange(3, 250) for _ in range(8)] for _ in range(2)]
    return [bases[i % 2] + [rng.randrange(3, 250) for _ in range(1 + i % 3)] for i in range(5)]


PROMPTS = _prompts()


class Run(NamedTuple):
    tokens: list[list[int]]
    rows: list[np.ndarray]  # per request [rows, L, K] logical expert ids
    metrics: dict[str, int]  # prefix_hit_blocks, swap_out_blocks, swap_in_blocks, preemptions


def generate(model: str, ep: int, **kw: object) -> Run:
    parallel = {"tensor_parallel_size": ep, "enable_expert_parallel": True} if ep > 1 else {}
    with LLM(model, block_size=4, max_num_seqs=3, num_gpu_blocks_override=8, num_cpu_blocks_override=32,
             routing_replay_config=R3, **parallel, **kw) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        metrics = llm.engine.metrics()
    for o in outs:
        assert o.outputs[0].error is None, o.outputs[0].error
    names = ("prefix_hit_blocks", "swap_out_blocks", "swap_in_blocks", "preemptions")
    return Run([o.outputs[0].token_ids for o in outs], [o.outputs[0].routed_experts for o in outs],
               {k: metrics[k] for k in names})


def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """checkpoints(tmp_path_factory)(family) -> a transformers-written tiny checkpoint with 4 kv heads, written once."""
    cache: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in cache:
            out = str(tmp_path_factory.mktemp(f"hf4-{family}"))
            cache[family] = write_hf_checkpoint(family, out, num_key_value_heads=4)
        return cache[family]

    return get


def assert_same_run(ep: Run, one: Run, family: str, ep_size: int) -> None:
    """Same schedule (hits, swaps, preemptions), same tokens, same logical R3 rows, bit for bit."""
    assert one.metrics["prefix_hit_blocks"] > 0 and one.metrics["preemptions"] > 0, one.metrics
    assert one.metrics["swap_out_blocks"] > 0 and one.metrics["swap_in_blocks"] > 0, one.metrics
    assert ep.metrics == one.metrics
    assert ep.tokens == one.tokens
    for i, (got, want) in enumerate(zip(ep.rows, one.rows, strict=True)):
        assert got.shape == want.shape == (len(PROMPTS[i]) + GREEDY.max_tokens - 1, len(MOE_LAYER_IDS[family]),
                                           want.shape[2])
        diff = np.argwhere(got != want)
        # a mismatch is a dispatch bug (a slot or rank id in a row) or a near-tie flipped by rounding: report
        # where, never loosen
        assert diff.size == 0, f"request {i}: {len(diff)} R3 entries differ, first [row, layer, k] = {diff[0]}"
    # logical ids of every rank's share, not the slots 0..E/N-1 any one rank numbers its experts by
    share = NUM_EXPERTS[family] // ep_size
    ranks = {int(e) // share for r in ep.rows for e in r.reshape(-1)}
    assert ranks == set(range(ep_size))
