"""Fused MoE experts in two Triton kernels over expert-aligned blocks (ops/moe_align.py).

Shape legend: T = tokens, H = hidden, I = expert intermediate (this rank's), E = experts, K = experts per
token, N = T * K flat rows (n = t * K + k), BM/BN/BK = block sizes.

    gate_up:  act[n]  = silu(x[n // K] @ w13[e, :I].T) * (x[n // K] @ w13[e, I:].T)      [N, I]
    down:     part[n] = topk_weight[n] * (act[n] @ w2[e].T)                               [N, H] float32
    out[t]    = sum_k part[t * K + k]                                                     [T, H]

Each program owns BM rows of ONE expert (align_to_blocks pads every expert's rows to BM) and BN output
columns, so every weight tile it streams is reused by its BM rows; programs past `num_padded` return at
once, which keeps the grid a function of the shape only (a CUDA graph can hold it). The final sum over
K runs in a fixed order (no atomics): the same inputs give the same bits, which R3 needs because the
next layer routes on this output.

The weights stay in the checkpoint's layout, w13 [E, 2I, H] and w2 [E, H, I] (K-contiguous), so the
loaded tiles are [BK, BN] read along K. float32 models multiply in IEEE float32 (not TF32), so that a
float32 CUDA model routes like the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdeploy_r3.model_executor.ops.moe_align import align_to_blocks

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; the torch loop then serves
    triton = None
    tl = None


def _jit(fn):  # noqa: ANN001, ANN202 (decorator)
    return fn if triton is None else triton.jit(fn)


@_jit
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w13_ptr,  # [E, 2I, H]
    act_ptr,  # [N, I]
    sorted_ids_ptr,  # [P] int32
    block_expert_ptr,  # [NB] int32
    num_padded_ptr,  # [1] int32
    num_rows,  # N
    hidden,  # H
    inter,  # I
    stride_xt,
    stride_we,
    stride_wn,
    stride_at,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    row_ok = rows < num_rows
    tok = rows // TOP_K  # [BM]
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = n < inter
    w_gate = w13_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn  # [1, BN]
    w_up = w_gate + inter * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = k < hidden
        a = tl.load(x_ptr + tok[:, None] * stride_xt + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w_gate + k[:, None], mask=w_mask, other=0.0)  # [BK, BN]
        wu = tl.load(w_up + k[:, None], mask=w_mask, other=0.0)  # [BK, BN]
        if IEEE:
            acc_gate = tl.dot(a, wg, acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, wu, acc_up, input_precision="ieee")
        else:
            acc_gate = tl.dot(a, wg, acc_gate)
            acc_up = tl.dot(a, wu, acc_up)
    gate = acc_gate.to(act_ptr.dtype.element_ty).to(tl.float32)  # round like the reference's linear output
    up = acc_up.to(act_ptr.dtype.element_ty).to(tl.float32)
    act = gate * tl.sigmoid(gate) * up  # [BM, BN]
    tl.store(act_ptr + rows[:, None] * stride_at + n[None, :], act.to(act_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@_jit
def _down_kernel(
    act_ptr,  # [N, I]
    w2_ptr,  # [E, H, I]
    part_ptr,  # [N, H] float32
    topk_weights_ptr,  # [N] float32
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_rows,
    hidden,
    inter,
    stride_at,
    stride_we,
    stride_wn,
    stride_pt,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    row_ok = rows < num_rows
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] hidden columns
    n_ok = n < hidden
    w_base = w2_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn  # [1, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = k < inter
        a = tl.load(act_ptr + rows[:, None] * stride_at + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN]
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    y = acc.to(act_ptr.dtype.element_ty).to(tl.float32)  # [BM, BN] rounded like the reference's linear output
    weight = tl.load(topk_weights_ptr + rows, mask=row_ok, other=0.0)  # [BM]
    tl.store(part_ptr + rows[:, None] * stride_pt + n[None, :], y * weight[:, None],
             mask=row_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class TritonMoeConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def pick_config(num_tokens: int, top_k: int, num_experts: int) -> TritonMoeConfig:
    """Block sizes by rows per expert: decode batches give an expert a handful of rows (BM 16, the
    smallest tl.dot tile; weight streaming dominates), prefill gives it hundreds (BM 64)."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 16:
        return TritonMoeConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if rows_per_expert <= 64:
        return TritonMoeConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)
    return TritonMoeConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


def triton_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: TritonMoeConfig | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights/ids [T, K] -> [T, H] in x.dtype.

    Same function as moe.loop_experts; no host sync (graph-safe).
    """
    if triton is None:
        raise RuntimeError("triton_experts needs triton; install fastdeploy_r3[triton]")
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_rows = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(x)
    if w13.stride(2) != 1 or w2.stride(2) != 1 or x.stride(1) != 1:
        raise ValueError("triton_experts: x, w13 and w2 must be contiguous in their last dimension")
    cfg = config or pick_config(num_tokens, top_k, num_experts)
    blocks = align_to_blocks(topk_ids, num_experts, cfg.block_m)
    ieee = x.dtype == torch.float32
    act = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)  # [N, I]
    _gate_up_kernel[(blocks.max_blocks, triton.cdiv(inter, cfg.block_n))](
        x, w13, act, blocks.sorted_ids, blocks.block_expert, blocks.num_padded,
        num_rows, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=ieee,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    part = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)  # [N, H]
    weights = topk_weights.reshape(-1).float().contiguous()  # [N]
    _down_kernel[(blocks.max_blocks, triton.cdiv(hidden, cfg.block_n))](
        act, w2, part, weights, blocks.sorted_ids, blocks.block_expert, blocks.num_padded,
        num_rows, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), part.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=ieee,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return part.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)  # [T, H]
