"""The routed experts' computation on the GPU: one entry point, two fused backends, chosen per batch size.

Shape legend: T = tokens, H = hidden, I = expert intermediate (this rank's), E = experts, K = experts per
token, N = T * K routed rows.

    backend       what runs
    "triton"      align_to_blocks + one expert-GEMM Triton kernel, launched twice (ops/fused_moe_triton.py)
    "grouped_mm"  sort_by_expert + two torch._grouped_mm (CUTLASS on sm90; bf16 only on CUDA)
    "loop"        moe.loop_experts: a Python loop over the experts hit (CPU, and the oracle)

Neither fused backend syncs with the host, so a decode step can be recorded in a CUDA graph. "auto"
picks by what tools/bench_moe.py measured on an H200 (bf16, Qwen3-30B-A3B experts, 48 layers, ms):

    batch                        1      16      64     256
    Triton, one CUDA graph     5.07   13.20   19.26   21.56     roofline 0.86 / 8.89 / 13.57 / 13.82
    grouped_mm, one graph      5.81   17.83   25.15   27.15
    Triton, eager             47.7    34.6    29.7    50.0      (host-bound: ~14 launches a layer)
    grouped_mm, eager         28.2    22.0    27.2    35.1

so Triton wherever the step is being recorded into a CUDA graph (and for every dtype but bf16), and
grouped_mm for bf16 steps launched eagerly, at every batch size. (Measured before the alignment became
one Triton launch, which cut ~25 kernels a layer from the Triton path: re-measure the eager choice.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from fastdeploy_r3.model_executor.ops.moe_align import sort_by_expert

BACKENDS = ("auto", "triton", "grouped_mm", "loop")

_graph_kernels = False


@contextmanager
def graph_kernels() -> Iterator[None]:
    """"auto" picks the graph kernels (Triton) inside, also for the eager warm-up run before a capture, so
    that the kernels compile before the capture and not during it."""
    global _graph_kernels
    prev, _graph_kernels = _graph_kernels, True
    try:
        yield
    finally:
        _graph_kernels = prev


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


def choose_backend(backend: str, x: torch.Tensor, batch_invariant: bool = False) -> str:
    """Resolve "auto": loop on the CPU; on CUDA Triton inside a graph capture or for non-bf16, else grouped_mm.
    batch_invariant: never grouped_mm (its GEMM tiles are picked by shape, model_executor/batch_invariant.py)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown MoE backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend != "auto":
        if batch_invariant and backend == "grouped_mm":
            raise ValueError("the grouped_mm MoE backend is not batch-invariant; use 'auto', 'triton' or 'loop'")
        return backend
    if not x.is_cuda:
        return "loop"
    if batch_invariant:
        return "triton"
    if x.dtype == torch.bfloat16 and not (_graph_kernels or torch.cuda.is_current_stream_capturing()):
        return "grouped_mm"
    return "triton"
