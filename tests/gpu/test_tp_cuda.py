"""Tensor parallelism on GPUs (NCCL): two worker ranks on two CUDA devices give the same greedy tokens
and R3 rows as one rank, for all three families, with the fast kernels and decode CUDA graphs.

Runs on a machine with two GPUs (the device tool's nvidia-h200-x2); skipped where fewer are visible.
Tiny fake models in float32, where router near-ties are vanishingly rare: a difference is reported with
its row, never tolerated.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import two_gpu_runs
from fake_model import make_fake_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (nvidia-h200-x2)"),
]

SEED = 11  # the prompts' (two_gpu_runs.prompts)


def run(model_dir: str, tp: int, **kw: object) -> tuple[list[list[int]], list[np.ndarray]]:
    return two_gpu_runs.run(model_dir, tp, SEED, **kw)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "glm4_moe"])
def test_tp2_on_two_gpus_equals_tp1(tmp_path, family: str) -> None:
    model_dir = make_fake_model(family, str(tmp_path / family), preset="tiny", seed=0)
    tokens1, rows1 = run(model_dir, tp=1)
    tokens2, rows2 = run(model_dir, tp=2)
    assert tokens2 == tokens1
    for i, (a, b) in enumerate(zip(rows2, rows1, strict=True)):
        diff = np.argwhere(a != b)
        assert a.shape == b.shape and diff.size == 0, f"request {i}: first differing [row, layer, k] {diff[:1]}"
