"""Expert parallelism on GPUs (NCCL): two worker ranks on two CUDA devices, each holding half the experts
whole and running them with the fused kernels on its own rows, give the greedy tokens and logical R3
rows of one rank, for all three families, with a redundant-expert (EPLB) placement file, and with the
all-to-all dispatch (--moe-a2a-backend alltoall); tools/bench_ep.py runs over NCCL.

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


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_ep2_alltoall_over_nccl_equals_one_rank(tmp_path, family: str) -> None:
    """--moe-a2a-backend alltoall: the rows travel by NCCL all_to_all_single and come back, each token summed
    over k by its owner and all-gathered (layers/expert_alltoall.py); glm4_moe's shared experts reduced apart."""
    model_dir = make_fake_model(family, str(tmp_path / family), preset="tiny", seed=0)
    got = run(model_dir, tp=2, enable_expert_parallel=True, moe_a2a_backend="alltoall")
    assert_same(got, run(model_dir, tp=1))


def test_bench_ep_runs_over_nccl(tmp_path) -> None:
    """tools/bench_ep.py on two GPUs: both dispatches time every stage, agree on the layer's output (bf16)."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "ep.json"
    cmd = [sys.executable, "tools/bench_ep.py", "--device", "cuda", "--ep", "2", "--preset", "qwen3-30b-a3b",
           "--tokens", "16", "256", "--png", str(tmp_path / "ep.png"), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 2 * 2 and all(r["layer_ms"] > 0 and r["bytes_sent"] > 0 for r in rows)
    assert all(r["max_rel_diff"] < 0.02 for r in rows)
