"""Expert parallelism smoke test on ONE GPU: EP=2 as two worker processes sharing the device
(FDR3_RANKS_SHARE_GPU=1: both ranks on cuda:0, a gloo group, eager steps), each holding half the experts
whole, gives the greedy tokens and logical R3 rows of one rank, with and without a redundant-expert
placement. The two-GPU NCCL run is tests/gpu/test_ep_cuda.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import two_gpu_runs
from fake_model import make_fake_model

from fastdeploy_r3.distributed.parallel_state import SHARE_GPU_ENV

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SEED = 13


def assert_same(got: tuple[list[list[int]], list[np.ndarray]], want: tuple[list[list[int]], list[np.ndarray]]) -> None:
    assert got[0] == want[0]
    for i, (a, b) in enumerate(zip(got[1], want[1], strict=True)):
        diff = np.argwhere(a != b)
        assert a.shape == b.shape and diff.size == 0, f"request {i}: first differing [row, layer, k] {diff[:1]}"


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_ep2_sharing_one_gpu_equals_one_rank(tmp_path, monkeypatch, family: str) -> None:
    model_dir = make_fake_model(family, str(tmp_path / family), preset="tiny", seed=0)
    want = two_gpu_runs.run(model_dir, 1, SEED)
    monkeypatch.setenv(SHARE_GPU_ENV, "1")
    assert_same(two_gpu_runs.run(model_dir, 2, SEED, enable_expert_parallel=True, enforce_eager=True), want)


def test_ep2_redundant_experts_sharing_one_gpu_keep_logical_ids(tmp_path, monkeypatch) -> None:
    model_dir = make_fake_model("qwen3_moe", str(tmp_path / "qwen3_moe"), preset="tiny", seed=0)
    placement = tmp_path / "placement.json"  # 20 slots for 16 experts, no slot p holding expert p
    placement.write_text(json.dumps({"physical_to_logical": [(p + 5) % 16 for p in range(16)] + [0, 7, 12, 5]}))
    want = two_gpu_runs.run(model_dir, 1, SEED)
    monkeypatch.setenv(SHARE_GPU_ENV, "1")
    got = two_gpu_runs.run(model_dir, 2, SEED, enable_expert_parallel=True, enforce_eager=True,
                           expert_placement_file=str(placement), moe_a2a_backend="alltoall")
    assert_same(got, want)
