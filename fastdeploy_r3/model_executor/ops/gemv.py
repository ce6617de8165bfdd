"""One row times a 16-bit weight, for the small linears of a batch-1 decode step (the MoE router gate).

At one row cuBLAS picks a split-K kernel for the router gate [E, H] that took 5 us a layer on the H200
(48 layers of Qwen3-30B-A3B: 0.24 ms of a 3.3 ms fp8 step) for 512 KB of weight. Here a program owns
BLOCK_N output rows and walks the whole reduction in BLOCK_K steps, float32 sums of 16-bit products, one
rounding to the output dtype at the end, as cuBLAS rounds (its summation order differs: a logit can land
one ulp away, which moves a router choice only where two experts were within that ulp).

Launched early (ops/triton_setup.py): the weight rows are prefetched into L2 while the norm before the
gate still runs, then the kernel waits for the activation.
"""

from __future__ import annotations

import torch
from torch import nn

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


@jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, out_cols, red_dim, stride_wn, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PDL: tl.constexpr, ROW_CHUNKS: tl.constexpr):  # fmt: skip
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = n < out_cols
    let_dependents_launch(PDL)  # the routing kernel may launch; it waits for these logits
    if PDL:
        prefetch_rows(w_ptr, n, n_ok, red_dim, stride_wn, ROW_CHUNKS, 16)  # 16-bit: 16 values a sector
        wait_for_inputs(PDL)
    k = tl.arange(0, BLOCK_K)  # [BK]
    rows = n[:, None].to(tl.int64) * stride_wn  # [BN, 1]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, red_dim, BLOCK_K):
        k_ok = k0 + k < red_dim
        w = tl.load(w_ptr + rows + k0 + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
        x = tl.load(x_ptr + k0 + k, mask=k_ok, other=0.0)  # [BK]
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def use_one_row_gemv(x: torch.Tensor, batch_invariant: bool = False) -> bool:
    """x is one 16-bit row on CUDA outside deterministic mode (whose linears keep a fixed reduction order
    for every batch size: batch_invariant.py): a one-row GEMV's case, here and in ops/fp8_gemv.py."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and not batch_invariant)  # fmt: skip


def one_row_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K] @ weight [O, K]^T -> [1, O] in x.dtype, one launch (float32 sums)."""
    require_triton("one_row_gemv")
    out_cols, red_dim = weight.shape
    if x.shape != (1, red_dim) or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"one_row_gemv: x {tuple(x.shape)} must be one contiguous row of {red_dim} values "
                         f"and weight {tuple(weight.shape)} contiguous along K")
    out = torch.empty(1, out_cols, dtype=x.dtype, device=x.device)
    use_pdl = pdl(x)
    _gemv_kernel[(triton.cdiv(out_cols, BLOCK_N),)](
        x, weight, out, out_cols, red_dim, weight.stride(0),
        BLOCK_N=BLOCK_N, BLOCK_K=min(MAX_BLOCK_K, triton.next_power_of_2(red_dim)), PDL=use_pdl,
        ROW_CHUNKS=triton.next_power_of_2(triton.cdiv(red_dim, 16)), num_warps=4, launch_pdl=use_pdl,
    )  # fmt: skip
    return out


def router_gate(x: torch.Tensor, gate: nn.Module, batch_invariant: bool = False) -> torch.Tensor:
    """The router logits x [T, H] -> [T, E] of gate (a bias-free linear holding weight [E, H]): the one-row
    GEMV where use_one_row_gemv says so and the weight has x's dtype, else gate(x) itself, which in
    deterministic mode is the fixed-tile linear make_batch_invariant made of it (RowTiledLinear)."""
    weight = gate.weight
    if getattr(gate, "bias", None) is None and weight.dtype == x.dtype and use_one_row_gemv(x, batch_invariant):
        return one_row_gemv(x, weight)
    return gate(x)
