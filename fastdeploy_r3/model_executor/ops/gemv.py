"""A few rows times a 16-bit weight, for the router gate of a batch-1 decode step or a speculative verify
step (its k + 1 rows).

At one row cuBLAS picks a split-K kernel for the router gate [E, H] that took 5 us a layer on the H200
(48 layers of Qwen3-30B-A3B: 0.24 ms of a 3.3 ms fp8 step) for 512 KB of weight, and about as long at 2 to
8 rows. Here a program owns BLOCK_N output rows and walks the whole reduction in BLOCK_K steps, float32
sums of 16-bit products, one rounding to the output dtype at the end, as cuBLAS rounds (its summation
order differs: a logit can land one ulp away, which moves a router choice only where two experts were
within that ulp). Each weight tile is loaded once for all the rows; each row's sums are the ones it gets
alone. 48 gate layers in one CUDA graph on the H200 (early launches off): 1 row 0.082 ms against cuBLAS
0.230, 4 rows 0.139 against 0.232, 8 rows 0.232 against 0.245.

Launched early (ops/triton_setup.py): the weight rows are prefetched into L2 while the kernel before the
gate still runs, then the kernel waits for the activation.

normed_gemv: at 1 to 4 rows (layers/moe.py FUSED_GATE_NORM_MAX_ROWS) the decoder layer's post-attention
RMSNorm (and its residual add) runs inside the gate's loads, one launch less; a grid column per row, each
program normalizing its row itself (ops/rms_norm.py's arithmetic, the same bits), the row's first writing
the normed row, which the experts read, and the sum, the next residual. (Normalizing every row in every
program, the tile loaded once for all, lost at 4 rows: docs/perf_h200.md, 2026-12-04, fifth session.)
"""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy_r3.model_executor.ops.rms_norm import normed_elements, row_inv_rms
from fastdeploy_r3.model_executor.ops.triton_setup import (
    jit,
    let_dependents_launch,
    pdl,
    prefetch_rows,
    require_triton,
    tl,
    triton,
    wait_for_inputs,
)

BLOCK_N = 2  # output rows a program: the gate's 128 experts in 64 programs
MAX_BLOCK_K = 2048
MAX_ROWS = 8  # the most rows one_row_gemv takes, and router_gate sends it (cuBLAS beyond)


@jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, out_cols, red_dim, stride_wn, rows_x, stride_x, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PDL: tl.constexpr, ROW_CHUNKS: tl.constexpr, ROWS: tl.constexpr,
                 residual_ptr=None, norm_weight_ptr=None, h_out_ptr=None, sum_out_ptr=None, eps=0.0,
                 NORM: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 1):  # fmt: skip
    """NORM (one row a grid column, program_id(1)): x's row is first normalized, x + residual through the
    RMSNorm norm_weight / eps, as it is loaded (ops/rms_norm.py's roundings); the row's first program writes
    the normed row to h_out_ptr and the sum to sum_out_ptr (all of x's row stride) for the kernels after it."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = n < out_cols
    let_dependents_launch(PDL)  # the routing kernel may launch; it waits for these logits
    if PDL:
        prefetch_rows(w_ptr, n, n_ok, red_dim, stride_wn, ROW_CHUNKS, 16)  # 16-bit: 16 values a sector
        wait_for_inputs(PDL)
    if NORM:
        row = tl.program_id(1)
        x_ptr += row * stride_x
        out_ptr += row * out_cols
        residual_ptr += row * stride_x
        h_out_ptr += row * stride_x
        sum_out_ptr += row * stride_x
        inv_rms = row_inv_rms(x_ptr, residual_ptr, red_dim, eps, NORM_BLOCK)
    k = tl.arange(0, BLOCK_K)  # [BK]
    rows = n[:, None].to(tl.int64) * stride_wn  # [BN, 1]
    r_idx = tl.arange(0, ROWS)  # [R]
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, red_dim, BLOCK_K):
        k_ok = k0 + k < red_dim
        w = tl.load(w_ptr + rows + k0 + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
        w = w.to(tl.float32)
        for r in tl.static_range(ROWS):  # the weight tile read once for every row; the rows never mix
            # the row test as a [BK] tensor (a scalar one breaks the interpreter's mask)
            x = tl.load(x_ptr + r * stride_x + k0 + k, mask=k_ok & (k * 0 + r < rows_x), other=0.0)  # [BK]
            if NORM:
                x, total = normed_elements(x, k0 + k, k_ok, inv_rms, residual_ptr, norm_weight_ptr)
                if tl.program_id(0) == 0:
                    tl.store(h_out_ptr + k0 + k, x, mask=k_ok)
                    tl.store(sum_out_ptr + k0 + k, total, mask=k_ok)
            part = tl.sum(w * x.to(tl.float32)[None, :], axis=1)  # [BN]
            acc += tl.where(r_idx[:, None] == r, part[None, :], 0.0)
    tl.store(out_ptr + r_idx[:, None] * out_cols + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(r_idx < rows_x)[:, None] & n_ok[None, :])


def use_one_row_gemv(x: torch.Tensor, batch_invariant: bool = False, max_rows: int = 1) -> bool:
    """x is 1 to max_rows 16-bit rows on CUDA outside deterministic mode (whose linears keep a fixed
    reduction order for every batch size: batch_invariant.py): a GEMV's case, here and in ops/fp8_gemv.py
    (max_rows > 1: the few rows of a speculative verify step or a tiny batch, the weight read once)."""
    return (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= max_rows
            and x.dtype in (torch.bfloat16, torch.float16) and not batch_invariant)  # fmt: skip


def one_row_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K] (1 <= T <= MAX_ROWS) @ weight [O, K]^T -> [T, O] in x.dtype, one launch (float32 sums; each
    row's are those it gets alone)."""
    require_triton("one_row_gemv")
    _check(x, weight, "one_row_gemv")
    return _launch(x, weight, x.shape[0], {})


def normed_gemv(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The RMSNorm before a gate fused into its GEMV, 1 to MAX_ROWS rows: s = x + residual, h = rms_norm(s,
    norm_weight, eps) -> (h @ weight^T [T, O], h, s), one launch instead of two; a grid column per row, each
    program normalizing its row itself as it loads it (ops/rms_norm.py's roundings: every row gets the bits
    it gets alone), the row's first writing h and s for the kernels after it."""
    require_triton("normed_gemv")
    red_dim = weight.shape[1]
    x, residual = x.contiguous(), residual.contiguous()  # the kernel steps all four by x's row stride
    _check(x, weight, "normed_gemv")
    if residual.shape != x.shape or norm_weight.shape != (red_dim,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"normed_gemv: residual {tuple(residual.shape)} must match x {tuple(x.shape)} and "
                         f"norm_weight {tuple(norm_weight.shape)} {norm_weight.dtype} be [{red_dim}] {x.dtype}")
    h, total = torch.empty_like(x), torch.empty_like(x)
    out = _launch(x, weight, 1, dict(residual_ptr=residual, norm_weight_ptr=norm_weight, h_out_ptr=h,
                                     sum_out_ptr=total, eps=eps, NORM=True,
                                     NORM_BLOCK=triton.next_power_of_2(red_dim)))  # fmt: skip
    return out, h, total


def _check(x: torch.Tensor, weight: torch.Tensor, name: str) -> None:
    red_dim = weight.shape[1]
    if (x.dim() != 2 or x.shape[1] != red_dim or not 1 <= x.shape[0] <= MAX_ROWS or x.stride(-1) != 1
            or weight.stride(-1) != 1):  # fmt: skip
        raise ValueError(f"{name}: x {tuple(x.shape)} must be 1 to {MAX_ROWS} rows of {red_dim} contiguous "
                         f"values and weight {tuple(weight.shape)} contiguous along K")


def _launch(x: torch.Tensor, weight: torch.Tensor, rows_per_program: int, norm: dict) -> torch.Tensor:
    """rows_per_program = T: each weight tile loaded once for all of x's rows; 1: a grid column per row."""
    out_cols, red_dim = weight.shape
    rows = x.shape[0]
    out = torch.empty(rows, out_cols, dtype=x.dtype, device=x.device)
    use_pdl = pdl(x)
    _gemv_kernel[(triton.cdiv(out_cols, BLOCK_N), rows // rows_per_program)](
        x, weight, out, out_cols, red_dim, weight.stride(0), rows_per_program, x.stride(0),
        BLOCK_N=BLOCK_N, BLOCK_K=min(MAX_BLOCK_K, triton.next_power_of_2(red_dim)), PDL=use_pdl,
        ROW_CHUNKS=triton.next_power_of_2(triton.cdiv(red_dim, 16)), ROWS=triton.next_power_of_2(rows_per_program),
        num_warps=4, launch_pdl=use_pdl, **norm,
    )  # fmt: skip
    return out


def router_gate(x: torch.Tensor, gate: nn.Module, batch_invariant: bool = False) -> torch.Tensor:
    """The router logits x [T, H] -> [T, E] of gate (a bias-free linear holding weight [E, H]): the one-row
    GEMV where use_one_row_gemv says so and the weight has x's dtype, else gate(x) itself, which in
    deterministic mode is the fixed-tile linear make_batch_invariant made of it (RowTiledLinear)."""
    weight = gate.weight
    if (getattr(gate, "bias", None) is None and weight.dtype == x.dtype
            and use_one_row_gemv(x, batch_invariant, MAX_ROWS)):  # fmt: skip
        return one_row_gemv(x, weight)
    return gate(x)
