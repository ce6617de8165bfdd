"""Batch-invariant y = x W^T (+ b): one Triton GEMM whose tile shape never depends on the number of rows.

cuBLAS picks its kernel (tile, split-K, reduction order) by M, N and K, so a row of x can come back with
other bits when the batch around it grows. Here every program computes a [BLOCK_M, BLOCK_N] tile of y
over its range of K in BLOCK_K steps, in order, with one config per weight (config_for: by the weight's
shape, never by M): a row's result depends on its own values and W only (rows past M are masked loads,
zeros that touch no other row).

    x [M, K] --- program (i, j, s): rows [i BM, (i + 1) BM), columns [j BN, (j + 1) BN) ---> y [M, N]
                 acc += x[rows, k0:k0+BK] @ W[cols, k0:k0+BK]^T   for k0 in K range s, in order

With split_k > 1 the K ranges' float32 partial sums go to a workspace and a second launch adds them in
range order: more programs for the few-row GEMMs of a decode step (one row tile, N / BN programs), and
still an order fixed by K alone. No host sync: decode steps capture into CUDA graphs. The drop-in for
F.linear where the model runs batch-invariant (model_executor/batch_invariant.py's invariant_linear picks
it for Triton).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdeploy_r3.model_executor.ops.triton_setup import INTERPRET, jit, mma, require_triton, tl, triton


@dataclass(frozen=True)
class MatmulConfig:
    """One tile shape for every M. split_k > 1 cuts K into split_k fixed ranges whose float32 partial sums
    are added in range order by a second launch: the sum's order depends on K and split_k only."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


CONFIG = MatmulConfig()


def config_for(num_cols: int, red_dim: int, dtype: torch.dtype) -> MatmulConfig:
    """The one config of a weight [N, K]: chosen by the weight's shape and dtype, never by M (the whole
    point). Measured on the H200 with tools/bench_invariant.py (Qwen3-30B-A3B shapes, us at M = 1 / 256 /
    2048): a decode step's few rows fill one row tile, so a narrow or long-K weight gets few programs, each
    walking all of K; fixed K ranges give it more.
      float32 (GLM's router)   2048 -> 128:  187 / 188 / 198 in one range, 27 / 29 / 112 in eight
      narrow (N <= 512)        the bf16 router gate: eight ranges as well
      long K (K >= 4096)       o 4096 -> 2048: 17.6 / 17.9 / 88 in one range, 8.7 / 13.9 / 110 in two of BK 128
      the rest (q/k/v, lm_head) one range of BK 64 (q/k/v: 10.0 / 17.2 / 106; cuBLAS 6.4 / 10.1 / 58)
    """
    if dtype == torch.float32 or num_cols <= 512:
        return MatmulConfig(split_k=8)
    if red_dim >= 4096:
        return MatmulConfig(block_k=128, split_k=2)
    return CONFIG


@jit
def _invariant_matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N], or x_ptr when not HAS_BIAS (never read)
    y_ptr,  # [M, N], or the float32 partial sums [SPLIT_K, M, N]
    num_rows,  # M
    num_cols,  # N
    red_dim,  # K
    k_per_split,  # K / SPLIT_K rounded up to BLOCK_K
    stride_x,
    stride_w,
    stride_y,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, red_dim)
    row_ok = rows < num_rows
    col_ok = cols < num_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = k < k_hi
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]  # fmt: skip
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w + k[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BK, BN]  # fmt: skip
        acc += mma(x, w, UPCAST)
    offs = rows[:, None].to(tl.int64) * stride_y + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + tl.program_id(2).to(tl.int64) * num_rows * stride_y + offs, acc, mask=mask)


@jit
def _sum_splits_kernel(
    part_ptr,  # [SPLIT_K, M, N] float32
    bias_ptr,  # [N], or part_ptr when not HAS_BIAS
    y_ptr,  # [M, N]
    num_rows,
    num_cols,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    size = (tl.zeros([BLOCK], dtype=tl.int64) + num_rows) * num_cols  # one split's sums; all of them overflow int32
    ok = i < size
    acc = tl.load(part_ptr + i, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):  # in range order, always
        acc += tl.load(part_ptr + s * size + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % num_cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)


def invariant_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: MatmulConfig | None = None
) -> torch.Tensor:
    """x [..., K], weight [N, K] (bias [N]) -> [..., N] in x's dtype, accumulated in float32, with the weight's
    config_for() unless `config` names one (benchmarks: a weight must see one config in every call)."""
    require_triton("invariant_matmul")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"invariant_matmul: x is {x.dtype}, weight {weight.dtype}"
                         f"{'' if bias is None else f', bias {bias.dtype}'}; cast them to one dtype first")
    num_cols, red_dim = weight.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, red_dim)  # [M, K]
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    num_rows = rows.shape[0]
    out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)  # [M, N]
    if num_rows:
        c = config or config_for(num_cols, red_dim, weight.dtype)
        k_per_split = triton.cdiv(triton.cdiv(red_dim, c.split_k), c.block_k) * c.block_k
        split = triton.cdiv(red_dim, k_per_split)  # ranges that hold any K (the last may be short)
        # split == 1 when K is one range: then the one launch writes y itself
        dest = out if split == 1 else torch.empty(split, num_rows, num_cols, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(num_rows, c.block_m), triton.cdiv(num_cols, c.block_n), split)
        _invariant_matmul_kernel[grid](
            rows, weight, rows if bias is None else bias, dest, num_rows, num_cols, red_dim, k_per_split,
            rows.stride(0), weight.stride(0), num_cols if split > 1 else out.stride(0), HAS_BIAS=bias is not None,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=split, UPCAST=INTERPRET,
            num_warps=c.num_warps, num_stages=c.num_stages,
        )  # fmt: skip
        if split > 1:
            block = 1024
            _sum_splits_kernel[(triton.cdiv(num_rows * num_cols, block),)](
                dest, dest if bias is None else bias, out, num_rows, num_cols, HAS_BIAS=bias is not None,
                SPLIT_K=split, BLOCK=block,
            )  # fmt: skip
    return out.reshape(*lead, num_cols)
