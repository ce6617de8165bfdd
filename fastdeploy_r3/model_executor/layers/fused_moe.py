"""The routed experts' computation on the GPU: one entry point, two fused backends, chosen per batch size.

Shape legend: T = tokens, H = hidden, I = expert intermediate (this rank's), E = experts, K = experts per
token, N = T * K routed rows.

    backend       what runs                                                  good for
    "triton"      align_to_blocks + two Triton kernels (ops/fused_moe_triton)  few tokens: 2 GEMM launches
    "grouped_mm"  sort_by_expert + two torch._grouped_mm (CUTLASS on sm90)     many tokens, bf16 only
    "loop"        moe.loop_experts: a Python loop over the experts hit        CPU, and the oracle

Neither fused backend syncs with the host, so a decode step can be recorded in a CUDA graph. Which one
"auto" picks per batch size is the table GROUPED_MM_MIN_TOKENS below, set from tools/bench_moe.py on an
H200 (bf16, Qwen3-30B-A3B expert shape); torch._grouped_mm's CUDA kernels take bf16 only, so other
dtypes always get Triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdeploy_r3.model_executor.ops.moe_align import sort_by_expert

BACKENDS = ("auto", "triton", "grouped_mm", "loop")

# From this many tokens on, "auto" takes torch._grouped_mm (bf16 on CUDA); below, the Triton kernels.
GROUPED_MM_MIN_TOKENS = 64


def grouped_mm_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights/ids [T, K] -> [T, H] (same function as loop_experts)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    order, offsets = sort_by_expert(topk_ids, num_experts)  # [N], [E]
    xs = x.index_select(0, order // top_k)  # [N, H] rows grouped by expert
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offsets)  # [N, 2I]
    act = F.silu(h[:, :inter]) * h[:, inter:]  # [N, I]
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offsets)  # [N, H]
    y = y.float() * topk_weights.reshape(-1)[order].float().unsqueeze(-1)  # [N, H]
    # back to flat-row order, then a fixed-order sum over K (index_add_ would add in a racy order)
    part = torch.empty(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device).index_copy_(0, order, y)
    return part.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)  # [T, H]


def choose_backend(backend: str, x: torch.Tensor) -> str:
    """Resolve "auto" for this batch: loop on the CPU, else Triton or grouped_mm by batch size and dtype."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown MoE backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    if not x.is_cuda:
        return "loop"
    if x.dtype == torch.bfloat16 and x.shape[0] >= GROUPED_MM_MIN_TOKENS:
        return "grouped_mm"
    return "triton"
