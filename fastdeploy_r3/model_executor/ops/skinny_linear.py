"""A narrow dense linear for a few rows (the router gate of a decode step at small batch): y = x @ W^T.

At M <= MAX_ROWS rows a GEMM is a matrix-vector product: each weight byte is read once and used M times,
so what matters is keeping enough loads in flight. On the H200 (tools/bench_linear.py, 48 weights of a
shape in one CUDA graph, bf16) cuBLAS takes 4.8 us for Qwen3-30B-A3B's router gate (128 x 2048, 0.5 MB)
at 1..8 rows, this kernel 2.2-3.0 us at 1..4 rows and 4.7 at 8: ~0.1 ms of a batch-1 decode step over 48
layers. For the wide weights cuBLAS already streams at 1.8-4.1 TB/s and this kernel was no faster (qkv
5120 x 2048: 8.0 against 8.9 us at one row, 26.6 at eight; o: 9.3 / 9.9; lm_head 150 / 141 at one row,
538 at eight), so linear() sends it only weights of at most MAX_OUT_FEATURES outputs.

    x [M, K]  W [N, K] (rows contiguous)  bias [N] or None  -> y [M, N] in x's dtype
    one program: BLOCK_N output features for every row; K walked in BLOCK_K steps. Each step loads the
    [BLOCK_N, BLOCK_K] weight tile once and, for each row in turn, adds sum_k W[n, k] * x[m, k] (float32
    products and sums) into that row's accumulator.

BLOCK_N and BLOCK_K depend on the weight's shape only, never on M, and a row's sum reads only its own x:
so each row's result is the same bits whatever M is and whatever the other rows hold (a graph padded to 4
rows gives a real row what an eager step of 3 gives it).
"""

from __future__ import annotations

import os

import torch

from fastdeploy_r3.model_executor.ops.triton_setup import jit, require_triton, tl, triton

MAX_ROWS = 8  # at 8 rows the router gate is already as slow here as in cuBLAS
MAX_OUT_FEATURES = 1024  # wider weights: cuBLAS spreads them over the SMs as well as this kernel does
MIN_PROGRAMS = 528  # ~4 programs per SM of an H200 (132 SMs): enough loads in flight to stream the weight
ELEMENTS_PER_TILE = 8192  # BLOCK_N x BLOCK_K: 64 float32 values per thread at 4 warps


def skinny_enabled() -> bool:
    """FDR3_SKINNY_LINEAR=0 sends every dense linear to torch (cuBLAS), for an A/B measurement."""
    return os.environ.get("FDR3_SKINNY_LINEAR", "1") != "0"


def tiles(out_features: int, in_features: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for a weight [out_features, in_features]: the widest BLOCK_N that still gives
    MIN_PROGRAMS programs (4 at least), and as much of K per step as ELEMENTS_PER_TILE allows."""
    block_n = 4
    for n in (16, 8):
        if triton.cdiv(out_features, n) >= MIN_PROGRAMS:
            block_n = n
            break
    block_k = min(triton.next_power_of_2(in_features), ELEMENTS_PER_TILE // block_n)
    return block_n, max(block_k, 16)


@jit(do_not_specialize=["rows"])
def _skinny_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N]
    rows,  # M <= PAD_ROWS
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    PAD_ROWS: tl.constexpr,  # a power of two >= M
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    offs_m = tl.arange(0, PAD_ROWS)  # [R]
    acc = tl.zeros((PAD_ROWS, BLOCK_N), dtype=tl.float32)  # [R, BN]
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)  # [BN, BK]  # fmt: skip
        for m in tl.static_range(PAD_ROWS):
            xm = tl.load(x_ptr + m * stride_xm + k, mask=k_mask & (k * 0 + m < rows), other=0.0).to(tl.float32)  # [BK]
            part = tl.sum(w * xm[None, :], axis=1)  # [BN]
            acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < rows) & n_mask[None, :])


def skinny_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_linear serves this call: a CUDA x of 1..MAX_ROWS rows, a weight of x's dtype with at
    most MAX_OUT_FEATURES rows, each contiguous."""
    return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.shape[0] <= MAX_OUT_FEATURES
            and weight.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and weight.stride(1) == 1 and triton is not None and skinny_enabled())  # fmt: skip


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x.dtype, for M <= MAX_ROWS (any N)."""
    require_triton("skinny_linear")
    rows, in_features = x.shape
    out_features = weight.shape[0]
    if rows > MAX_ROWS:
        raise ValueError(f"skinny_linear serves at most {MAX_ROWS} rows, got {rows}")
    if weight.shape[1] != in_features or weight.stride(1) != 1:
        raise ValueError(f"skinny_linear: weight {tuple(weight.shape)} must be [N, {in_features}] with contiguous rows")
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    block_n, block_k = tiles(out_features, in_features)
    _skinny_kernel[(triton.cdiv(out_features, block_n),)](
        x, weight, bias, out, rows, out_features, in_features, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, PAD_ROWS=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4,
    )  # fmt: skip
    return out
