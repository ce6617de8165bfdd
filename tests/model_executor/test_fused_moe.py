"""Fused MoE on the CPU: the device-side alignment on exact scenarios, torch._grouped_mm and the two
Triton kernels (real interpreter) against the loop oracle, for the three gating families."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fastdeploy_r3.model_executor.layers.fused_moe import choose_backend, grouped_mm_experts
from fastdeploy_r3.model_executor.layers.moe import loop_experts
from fastdeploy_r3.model_executor.ops.moe_align import align_to_blocks, max_padded_rows, sort_by_expert

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_align_pads_each_expert_to_whole_blocks() -> None:
    """T=2, K=2, 3 experts, BM 4: expert 0 gets row 1, expert 1 row 3, expert 2 rows 0 and 2; N=4 pads."""
    blocks = align_to_blocks(torch.tensor([[2, 0], [2, 1]]), num_experts=3, block_m=4)
    assert blocks.sorted_ids.tolist() == [1, 4, 4, 4, 3, 4, 4, 4, 0, 2, 4, 4, 4, 4, 4, 4]
    assert blocks.block_expert.tolist() == [0, 1, 2, 2]
    assert blocks.num_padded.tolist() == [12]


def test_align_skips_experts_without_rows_and_fills_whole_blocks() -> None:
    """5 rows of expert 3 and 1 of expert 0 with BM 4: expert 0 -> block 0, expert 3 -> blocks 1, 2."""
    blocks = align_to_blocks(torch.tensor([[3, 3], [3, 0], [3, 3]]), num_experts=4, block_m=4)
    assert blocks.sorted_ids[:12].tolist() == [3, 6, 6, 6, 0, 1, 2, 4, 5, 6, 6, 6]
    assert blocks.block_expert[:3].tolist() == [0, 3, 3]
    assert blocks.num_padded.tolist() == [12]
    assert blocks.sorted_ids.shape[0] == max_padded_rows(6, 4, 4) == 20  # 6 rows + 4 partial blocks, rounded


def test_align_on_random_routing_keeps_every_row_once_in_its_experts_block() -> None:
    torch.manual_seed(0)
    for num_tokens, num_experts, top_k, block_m in ((1, 128, 8, 16), (37, 16, 4, 16), (300, 64, 8, 64)):
        ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])  # [T, K]
        blocks = align_to_blocks(ids, num_experts, block_m)
        used = blocks.sorted_ids[: int(blocks.num_padded)].long()
        real = used[used < ids.numel()]
        assert sorted(real.tolist()) == list(range(ids.numel()))
        row_block = (used < ids.numel()).nonzero().squeeze(1) // block_m  # block of each real row
        assert torch.equal(blocks.block_expert[row_block].long(), ids.reshape(-1)[real])
        order, offsets = sort_by_expert(ids, num_experts)
        assert torch.equal(ids.reshape(-1)[order], ids.reshape(-1).sort(stable=True).values)
        assert offsets[-1].item() == ids.numel()


def _random_moe(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype):
    x = torch.randn(num_tokens, hidden, dtype=dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden) * 0.1).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter) * 0.1).to(dtype)
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_matches_the_loop(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    for shape in ((1, 8, 2, 32, 16), (19, 16, 4, 64, 48)):
        x, w13, w2, weights, ids = _random_moe(*shape, dtype)
        ref = loop_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
        got = grouped_mm_experts(x, w13, w2, weights, ids).double()
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < (1e-6 if dtype == torch.float32 else 2e-2), (shape, err)


def test_auto_backend_is_the_loop_on_the_cpu() -> None:
    assert choose_backend("auto", torch.zeros(4, 8)) == "loop"
    assert choose_backend("triton", torch.zeros(4, 8)) == "triton"
    with pytest.raises(ValueError, match="unknown MoE backend 'fast'"):
        choose_backend("fast", torch.zeros(4, 8))


def test_triton_kernels_match_the_loop_for_three_gatings_under_the_interpreter() -> None:
    """The one-launch alignment kernel equals the torch alignment; ragged token counts through the Triton
    expert kernels (TRITON_INTERPRET=1, float32): the same output (1e-5; the K slots summed in the down
    GEMM or by the separate launch: the same bits) and the same captured ids as the loop, for Qwen3
    (softmax, no renorm), Mixtral and GLM blocks."""
    body = textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch
        from fastdeploy_r3.model_executor.forward_context import ForwardContext, set_forward_context
        from fastdeploy_r3.model_executor.layers.moe import SparseMoeBlock, loop_experts
        from fastdeploy_r3.model_executor.ops import arrivals, fused_moe_triton
        from fastdeploy_r3.model_executor.ops.fused_moe_triton import TritonMoeConfig, triton_experts

        from fastdeploy_r3.model_executor.ops.moe_align import align_to_blocks_torch, align_to_blocks_triton

        torch.manual_seed(1)
        for T, E, K, BM in ((1, 128, 8, 16), (2, 3, 2, 4), (37, 16, 4, 16), (256, 128, 8, 16), (64, 60, 4, 32)):
            ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
            a, b = align_to_blocks_triton(ids, E, BM), align_to_blocks_torch(ids, E, BM)
            n = int(b.num_padded)
            assert int(a.num_padded) == n and (a.sorted_ids[n:] == ids.numel()).all(), T
            # the interpreter runs the atomics in lane order: even the order inside a block is the torch one
            assert torch.equal(a.sorted_ids[:n], b.sorted_ids[:n]), T
            assert torch.equal(a.block_expert[: n // BM], b.block_expert[: n // BM]), T

        class Sink:
            def __init__(self): self.ids = []
            def capture(self, i, ids): self.ids.append(ids.clone())

        torch.manual_seed(0)
        for T, E, K, H, I in ((1, 8, 2, 32, 16), (7, 16, 4, 64, 40), (33, 16, 4, 48, 32)):
            x = torch.randn(T, H)
            w13, w2 = torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1
            ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
            w = torch.rand(T, K)
            ref = loop_experts(x, w13, w2, w, ids)
            for cfg in (None, TritonMoeConfig(16, 16, 16, 4, 1)):
                got = triton_experts(x, w13, w2, w, ids, cfg)
                assert ((got - ref).norm() / ref.norm()).item() < 1e-5, (T, cfg)
                # the slots summed by the down GEMM's last program equal the separate sum launch, bit for bit,
                # and leave every arrival counter at zero
                assert int(arrivals._buffers[torch.device("cpu")].abs().sum()) == 0, (T, cfg)
                fused_moe_triton.arrival_counters = lambda device, n: None
                assert torch.equal(triton_experts(x, w13, w2, w, ids, cfg), got), (T, cfg)
                fused_moe_triton.arrival_counters = arrivals.arrival_counters
        blocks = {
            "qwen3 (norm_topk_prob false)": dict(router="softmax", renormalize=False),
            "mixtral": dict(router="softmax", renormalize=True),
            "glm": dict(router="sigmoid_grouped", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        shared_intermediate_size=24),
        }
        for name, kw in blocks.items():
            block = SparseMoeBlock(32, 16, 4, 24, moe_index=0, **kw)
            for p in block.parameters():
                torch.nn.init.normal_(p, std=0.3)
            x = torch.randn(9, 32)
            outs, sinks = {}, {}
            for backend in ("loop", "triton"):
                block.experts.backend = backend
                sinks[backend] = Sink()
                with set_forward_context(ForwardContext(None, [], sinks[backend])):
                    outs[backend] = block(x)
            assert torch.equal(sinks["loop"].ids[0], sinks["triton"].ids[0]), name
            err = ((outs["triton"] - outs["loop"]).norm() / outs["loop"].norm()).item()
            assert err < 1e-5, (name, err)
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", body], check=False, capture_output=True, text=True, timeout=300,
                          cwd=REPO_ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr
