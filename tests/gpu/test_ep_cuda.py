"""Expert parallelism on GPUs (NCCL): two worker ranks on two CUDA devices, each holding half the experts
whole and running them with the fused kernels on its own rows, give the greedy tokens and logical R3
rows of one rank, for all three families, and with a redundant-expert (EPLB) placement file.

Runs on a machine with two GPUs (the device tool's nvidia-h200-x2); skipped where fewer are visible.
Tiny fake models in float32 (router near-ties vanishingly rare): a difference is reported with its row.
EP steps run eagerly (the dispatch syncs with the host; docs/expert_parallel.md).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import two_gpu_runs
from fake_model import make_fake_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (nvidia-h200-x2)"),
]

SEED = 13  # the prompts' (two_gpu_runs.prompts)


def run(model_dir: str, tp: int, **kw: object) -> tuple[list[list[int]], list[np.ndarray]]:
    return two_gpu_runs.run(model_dir, tp, SEED, **kw)


def assert_same(got: tuple[list[list[int]], list[np.ndarray]], want: tuple[list[list[int]], list[np.ndarray]]) -> None:
    assert got[0] == want[0]
    for i, (a, b) in enumerate(zip(got[1], want[1], strict=True)):
        diff = np.argwhere(a != b)
        assert a.shape == b.shape and diff.size == 0, f"request {i}: first differing [row, layer, k] {diff[:1]}"


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "glm4_moe"])
def test_ep2_on_two_gpus_equals_one_rank(tmp_path, family: str) -> None:
    model_dir = make_fake_model(family, str(tmp_path / family), preset="tiny", seed=0)
    assert_same(run(model_dir, tp=2, enable_expert_parallel=True), run(model_dir, tp=1))


def test_ep2_with_redundant_experts_on_two_gpus_equals_one_rank(tmp_path) -> None:
    model_dir = make_fake_model("qwen3_moe", str(tmp_path / "qwen3_moe"), preset="tiny", seed=0)
    placement = tmp_path / "placement.json"  # 20 slots for 16 experts, no slot p holding expert p
    placement.write_text(json.dumps({"physical_to_logical": [(p + 5) % 16 for p in range(16)] + [0, 7, 12, 5]}))
    got = run(model_dir, tp=2, enable_expert_parallel=True, expert_placement_file=str(placement))
    assert_same(got, run(model_dir, tp=1))
