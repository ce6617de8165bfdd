"""Tensor parallelism on GPUs (NCCL): two worker ranks on two CUDA devices give the same greedy tokens
and R3 rows as one rank, for all three families, with the fast kernels and decode CUDA graphs.

Runs on a machine with two GPUs (the device tool's nvidia-h200-x2); skipped where fewer are visible.
Tiny fake models in float32, where router near-ties are vanishingly rare: a difference is reported with
its row, never tolerated.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from fake_model import make_fake_model

from fastdeploy_r3 import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (nvidia-h200-x2)"),
]

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
R3 = {"enable_routing_replay": True}


def _prompts() -> list[list[int]]:
    """Three 24-token prefixes, each reused by several requests with different tails."""
    rng = random.Random(11)
    bases = [[rng.randrange(3, 500) for _ in range(24)] for _ in range(3)]
    return [bases[i % 3] + [rng.randrange(3, 500) for _ in range(1 + i % 5)] for i in range(12)]


def run(model_dir: str, tp: int, **kw: object) -> tuple[list[list[int]], list[np.ndarray]]:
    with LLM(model_dir, device="cuda", dtype="float32", tensor_parallel_size=tp, block_size=4, max_num_seqs=4,
             num_gpu_blocks_override=256, routing_replay_config=R3, **kw) as llm:  # fmt: skip
        outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    for o in outs:
        assert o.outputs[0].error is None, o.outputs[0].error
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].routed_experts for o in outs]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "glm4_moe"])
def test_tp2_on_two_gpus_equals_tp1(tmp_path, family: str) -> None:
    model_dir = make_fake_model(family, str(tmp_path / family), preset="tiny", seed=0)
    tokens1, rows1 = run(model_dir, tp=1)
    tokens2, rows2 = run(model_dir, tp=2)
    assert tokens2 == tokens1
    for i, (a, b) in enumerate(zip(rows2, rows1, strict=True)):
        diff = np.argwhere(a != b)
        assert a.shape == b.shape and diff.size == 0, f"request {i}: first differing [row, layer, k] {diff[:1]}"
