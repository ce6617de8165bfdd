"""Batch-invariant y = x W^T (+ b): one Triton GEMM whose tile shape never depends on the number of rows.

cuBLAS picks its kernel (tile, split-K, reduction order) by M, N and K, so a row of x can come back with
other bits when the batch around it grows. Here every program computes a [BLOCK_M, BLOCK_N] tile of y
over the whole K in BLOCK_K steps, in order, with the same constants for every M: a row's result depends
on its own values and W only (rows past M are masked loads, zeros that touch no other row).

    x [M, K] --- program (i, j): rows [i BM, (i + 1) BM), columns [j BN, (j + 1) BN) ---> y [M, N]
                 acc += x[rows, k0:k0+BK] @ W[cols, k0:k0+BK]^T   for k0 = 0, BK, 2 BK, ...

One launch, no host sync: decode steps capture into CUDA graphs. The drop-in for F.linear where the
model runs batch-invariant (model_executor/batch_invariant.py's invariant_linear picks it for Triton).
"""

from __future__ import annotations

import torch

from fastdeploy_r3.model_executor.ops.triton_setup import INTERPRET, jit, mma, require_triton, tl, triton

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64  # fixed for every M: the whole point
NUM_WARPS, NUM_STAGES = 4, 3


@jit
def _invariant_matmul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N], or x_ptr when not HAS_BIAS (never read)
    y_ptr,  # [M, N]
    num_rows,  # M
    num_cols,  # N
    red_dim,  # K
    stride_x,
    stride_w,
    stride_y,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    row_ok = rows < num_rows
    col_ok = cols < num_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, red_dim, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = k < red_dim
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]  # fmt: skip
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w + k[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BK, BN]  # fmt: skip
        acc += mma(x, w, UPCAST)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K] (bias [N]) -> [..., N] in x's dtype, accumulated in float32."""
    require_triton("invariant_matmul")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"invariant_matmul: x is {x.dtype}, weight {weight.dtype}"
                         f"{'' if bias is None else f', bias {bias.dtype}'}; cast them to one dtype first")
    num_cols, red_dim = weight.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, red_dim)  # [M, K]
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(rows.shape[0], num_cols, dtype=x.dtype, device=x.device)  # [M, N]
    if rows.shape[0]:
        grid = (triton.cdiv(rows.shape[0], BLOCK_M), triton.cdiv(num_cols, BLOCK_N))
        _invariant_matmul_kernel[grid](
            rows, weight, rows if bias is None else bias, out, rows.shape[0], num_cols, red_dim,
            rows.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, UPCAST=INTERPRET,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )  # fmt: skip
    return out.reshape(*lead, num_cols)
