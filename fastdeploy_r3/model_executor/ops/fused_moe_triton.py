"""Fused MoE experts: one expert-GEMM Triton kernel over expert-aligned blocks (ops/moe_align.py), launched twice.

Shape legend: T = tokens, H = hidden, I = expert intermediate (this rank's), E = experts, K = experts per
token, N = T * K flat rows (n = t * K + k), BM/BN/BK = block sizes.

    gate_up:  act[n]  = silu(x[n // K] @ w13[e, :I].T) * (x[n // K] @ w13[e, I:].T)      [N, I]
    down:     part[n] = topk_weight[n] * (act[n] @ w2[e].T)                               [N, H] float32
    out[t]    = sum_k part[t * K + k]                                                     [T, H]

The two launches differ only in constexpr flags: GATED (two accumulators, silu(gate) * up) for gate_up,
ROUTED_WEIGHT (scaled by the row's router weight, float32 out) for down; the prologue (which block,
which expert, which rows) and the K loop are written once. Each program owns BM rows of ONE expert
(align_to_blocks pads every expert's rows to BM) and BN output columns, so every weight tile it streams
is reused by its BM rows; programs past `num_padded` return at once, which keeps the grid a function of
the shape only (a CUDA graph can hold it). The final sum over K runs in a fixed order (no atomics): the
same inputs give the same bits, which R3 needs because the next layer routes on this output.

ops/fp8_linear.py runs the kernel DENSE (one expert that every row goes to) and, for a few rows whose
tiles leave the GPU idle, SPLIT_K: program_id(2) sums one K chunk and the last of a tile's splits to land
adds the chunks in split order (ops/arrivals.py), which regroups the float32 sum but never depends on timing.

The weights stay in the checkpoint's layout, w13 [E, 2I, H] and w2 [E, H, I] (K-contiguous), so the
loaded tiles are [BK, BN] read along K. float32 models multiply in IEEE float32 (not TF32), so that a
float32 CUDA model routes like the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdeploy_r3.model_executor.ops.arrivals import arrival_counters, ordered_sum
from fastdeploy_r3.model_executor.ops.fp8_quant import TL_DTYPES, quantize_groups
from fastdeploy_r3.model_executor.ops.moe_align import MoeBlocks, align_to_blocks
from fastdeploy_r3.model_executor.ops.triton_setup import INTERPRET, jit, require_triton, tl, triton


@jit
def _dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b in float32; IEEE keeps float32 operands at full precision (never TF32). UPCAST (the
    interpreter, triton_setup.INTERPRET) multiplies 16-bit operands as float32: the interpreter's dot
    takes bfloat16 tiles as their raw bits (triton_setup.mma says more); the products are exact either way."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@jit
def _expert_gemm_kernel(
    a_ptr,  # GATED: x [T, H]; else act [N, I]
    w_ptr,  # GATED: w13 [E, 2I, H]; else w2 [E, H, I]
    out_ptr,  # GATED: act [N, I]; else part [N, H] float32
    topk_weights_ptr,  # [N] float32 when ROUTED_WEIGHT, else None (then not a kernel parameter at all)
    sorted_ids_ptr,  # [P] int32
    block_expert_ptr,  # [NB] int32
    num_padded_ptr,  # [1] int32
    num_rows,  # N
    hidden,  # H
    inter,  # I
    stride_a,
    stride_we,
    stride_wn,
    stride_out,
    w_scale_ptr,  # FP8_W: the weight's scale rows, w13 [E, 2I, ceil(H/128)] or w2 [E, H, ceil(I/128)] float32
    stride_se,
    stride_sn,
    A_ROW_DIV: tl.constexpr,  # a row of flat row n: n // K for x (GATED), n for act
    GATED: tl.constexpr,  # silu(a @ w[:I].T) * (a @ w[I:].T), stored in out's dtype
    ROUTED_WEIGHT: tl.constexpr,  # (a @ w.T) * topk_weight[n], stored as float32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    FP8_W: tl.constexpr,  # w holds float8_e4m3fn codes: each tile is dequantised as it is loaded
    DENSE: tl.constexpr = False,  # one expert that every row goes to, in order (ops/fp8_linear.py): no routing
    final_ptr=None,  # SUM_SLOTS: out [T, H] in the activations' dtype
    arrivals_ptr=None,  # SUM_SLOTS: [T, grid n] int32 counters, zero between launches (ops/arrivals.py)
    SUM_SLOTS: tl.constexpr = False,  # ROUTED_WEIGHT only: a token's last slot to land sums its TOP_K slots
    TOP_K: tl.constexpr = 1,
    a_scale_ptr=None,  # FP8_A: a's group scales [rows of a, ceil(red_dim/128)] float32 (ops/fp8_quant.py)
    stride_as=0,
    FP8_A: tl.constexpr = False,  # FP8_W too: a holds fp8 codes, each 128-wide K step one fp8 MMA (W8A8)
    ACT_DTYPE: tl.constexpr = None,  # FP8_A: the model's dtype, which the linear's output is rounded to
    part_ptr=None,  # SPLIT_K: float32 partial sums [SPLIT_K, rows, out_cols]
    k_chunk=0,  # SPLIT_K: the reduction columns of one split, a multiple of BLOCK_K
    SPLIT_K: tl.constexpr = 1,  # DENSE only: program_id(2) sums one K chunk; the last to land adds them up
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if DENSE:
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
        expert = 0
    else:
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM] flat rows
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    row_ok = rows < num_rows
    a_rows = rows // A_ROW_DIV  # [BM]
    if GATED:  # x [T, H] @ w13[e].T -> act [N, I]
        out_cols = inter
        red_dim = hidden
    else:  # act [N, I] @ w2[e].T -> part [N, H]
        out_cols = hidden
        red_dim = inter
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
    n_ok = n < out_cols
    w_base = w_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn  # [1, BN] (the gate half if GATED)
    w_up = w_base + out_cols * stride_wn  # [1, BN] the up half, used only when GATED
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo, k_hi = 0, red_dim
    if SPLIT_K > 1:
        k_lo = tl.program_id(2) * k_chunk
        k_hi = tl.minimum(red_dim, k_lo + k_chunk)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = k < red_dim
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        w = tl.load(w_base + k[:, None], mask=w_mask, other=0.0)  # [BK, BN]
        if FP8_W:  # BLOCK_K divides 128: one scale column a tile
            s_rows = w_scale_ptr + expert * stride_se + n.to(tl.int64) * stride_sn  # [BN] scale rows
            s = tl.load(s_rows + k0 // 128, mask=n_ok, other=0.0)  # [BN]
        if GATED:
            wu = tl.load(w_up + k[:, None], mask=w_mask, other=0.0)  # [BK, BN] the up half
            if FP8_W:
                su = tl.load(s_rows + out_cols * stride_sn + k0 // 128, mask=n_ok, other=0.0)  # [BN]
        if FP8_A:  # fp8 x fp8 products summed in float32, then scaled by a's group scale x w's block scale
            a_s = tl.load(a_scale_ptr + a_rows * stride_as + k0 // 128, mask=row_ok, other=0.0)  # [BM]
            zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc += _dot(a, w, zero, False, UPCAST) * a_s[:, None] * s[None, :]
            if GATED:
                acc_up += _dot(a, wu, zero, False, UPCAST) * a_s[:, None] * su[None, :]
        else:
            if FP8_W:  # code x its 128x128 block's scale, in float32, rounded once to the activations' dtype
                # (quantization/fp8.py dequantize's arithmetic)
                w = (w.to(tl.float32) * s[None, :]).to(a_ptr.dtype.element_ty)
                if GATED:
                    wu = (wu.to(tl.float32) * su[None, :]).to(a_ptr.dtype.element_ty)
            acc = _dot(a, w, acc, IEEE, UPCAST)
            if GATED:
                acc_up = _dot(a, wu, acc_up, IEEE, UPCAST)
    # round like the reference's linear output, in the activations' dtype (x's for GATED, act's otherwise;
    # the model's under FP8_A, where a holds codes)
    if FP8_A:
        y = acc.to(ACT_DTYPE).to(tl.float32)  # [BM, BN]
        up = acc_up.to(ACT_DTYPE).to(tl.float32)
    else:
        y = acc.to(a_ptr.dtype.element_ty).to(tl.float32)  # [BM, BN]
        up = acc_up.to(a_ptr.dtype.element_ty).to(tl.float32)
    if GATED:
        y = y * tl.sigmoid(y) * up  # [BM, BN] silu(gate) * up
    if ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + rows, mask=row_ok, other=0.0)  # [BM]
        tl.store(out_ptr + rows[:, None] * stride_out + n[None, :], y * weight[:, None],
                 mask=row_ok[:, None] & n_ok[None, :])
        if SUM_SLOTS:  # _sum_slots_kernel's sum, done by the program that lands a token's last slot
            tl.debug_barrier()  # this program's part stores come before its rows count in
            token = rows // TOP_K  # [BM]
            arrival = arrivals_ptr + token * tl.num_programs(1) + pid_n  # [BM] one counter per (token, tile)
            last = row_ok & (tl.atomic_add(arrival, 1, mask=row_ok, sem="acq_rel") == TOP_K - 1)  # [BM]
            tl.store(arrival, tl.zeros_like(token).to(tl.int32), mask=last)  # zero again for the next launch
            mask = last[:, None] & n_ok[None, :]
            slot0 = out_ptr + (token * TOP_K)[:, None] * stride_out + n[None, :]  # [BM, BN] part[t, 0]
            total = ordered_sum(slot0, stride_out, TOP_K, mask)  # slot order, as _sum_slots_kernel adds them
            tl.store(final_ptr + token[:, None] * out_cols + n[None, :], total.to(final_ptr.dtype.element_ty),
                     mask=mask)
    elif SPLIT_K > 1:  # this split's sum, unrounded; the last of the tile's splits adds them in split order
        mask = row_ok[:, None] & n_ok[None, :]
        part = part_ptr + rows[:, None] * out_cols + n[None, :]  # [BM, BN] in split 0
        tl.store(part + tl.program_id(2) * num_rows * out_cols, acc, mask=mask)
        tl.debug_barrier()  # all of this program's partial stores come before its arrival
        arrival = arrivals_ptr + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(arrival, 1, sem="acq_rel") == SPLIT_K - 1:
            tl.store(arrival, 0)  # zero again for the next launch (the only program still counting)
            total = ordered_sum(part, num_rows * out_cols, SPLIT_K, mask)  # in split order
            rounded = total.to(ACT_DTYPE) if FP8_A else total.to(a_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None] * stride_out + n[None, :], rounded.to(out_ptr.dtype.element_ty),
                     mask=mask)
    else:
        tl.store(out_ptr + rows[:, None] * stride_out + n[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class TritonMoeConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@jit
def _sum_slots_kernel(part_ptr, out_ptr, num_tokens, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, h] = ((part[t, 0, h] + part[t, 1, h]) + part[t, 2, h]) + ... in float32, cast once: the K - 1
    adds and the cast of a loop over the slots, in one launch. part [T, K, H] contiguous."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # flat index into out [T, H]
    ok = i < num_tokens * hidden
    src = (i // hidden) * TOP_K * hidden + i % hidden  # part[t, 0, h]
    acc = tl.load(part_ptr + src, mask=ok, other=0.0)
    for k in tl.static_range(1, TOP_K):
        acc = acc + tl.load(part_ptr + src + k * hidden, mask=ok, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


# deterministic mode: one config for every batch, so a row's reduction order (BLOCK_K steps of one MMA
# shape) never changes with the number of rows an expert receives (model_executor/batch_invariant.py)
BATCH_INVARIANT_CONFIG = TritonMoeConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3)


def pick_config(num_tokens: int, top_k: int, num_experts: int) -> TritonMoeConfig:
    """Block sizes by rows per expert: decode batches give an expert a handful of rows (BM 16, the
    smallest tl.dot tile; weight streaming dominates), prefill gives it hundreds (BM 64)."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 16:
        return TritonMoeConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if rows_per_expert <= 64:
        return TritonMoeConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)
    return TritonMoeConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


# fp8 weights with 16-bit activations run W8A8 at every batch size: a token's activation codes depend on its
# own row only, so its result does not switch arithmetic with the number of rows beside it (weight-only
# dequantising loads were 5 % faster at one token but slower from 16, and a switch at a row count changed
# the routing of a prompt's tail recomputed after a prefix hit). tools/bench_fp8.py on the H200, 48 layers of
# Qwen3-30B-A3B experts, ms: 1 token 1.13 (bf16 1.27), 16: 5.67, 64: 8.29, 256: 10.18 (bf16 15.60, fp8
# weight-only 13.30); 64-row blocks for prefill (2048 tokens: 31.95 against bf16's 34.85)
# 1-2 tokens stream narrower tiles with more loads in flight; from 3 tokens the wider ones were faster in the
# engine (tools/bench_spec.py, fp8 Qwen3-30B-A3B on the H200, narrow / wide, ms, two alternating runs each):
# 2 tokens, verify k = 1 at batch 1 4.53, 4.53 / 4.64, 4.65; 4 tokens, k = 3 5.64, 5.79 / 5.49, 5.60 and k = 1
# at batch 2 5.76, 5.61 / 5.40, 5.42; 8 tokens, k = 3 at batch 2 7.57, 7.34 / 7.21, 7.25 and a pipelined
# batch-8 decode step 6.81, 6.81 / 6.70, 6.69
NARROW_MAX_TOKENS = 2


def pick_fp8_config(num_tokens: int, top_k: int, num_experts: int) -> TritonMoeConfig:
    """The W8A8 block config; the block_m is pick_config's (the fused routing kernel aligns the ids for it)."""
    block_m = pick_config(num_tokens, top_k, num_experts).block_m
    if num_tokens <= NARROW_MAX_TOKENS:
        return TritonMoeConfig(block_m=block_m, block_n=32, block_k=128, num_warps=4, num_stages=5)
    return TritonMoeConfig(block_m=block_m, block_n=64, block_k=128, num_warps=4, num_stages=3)


def triton_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: TritonMoeConfig | None = None,
    blocks: MoeBlocks | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    batch_invariant: bool = False,
    fp8_activations: bool | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights/ids [T, K] -> [T, H] in x.dtype.

    Same function as moe.loop_experts; no host sync (graph-safe). blocks: topk_ids already aligned (the
    fused routing kernel does it in its own launch); used when aligned for this batch's block size.
    w13_scale [E, 2I, ceil(H/128)], w2_scale [E, H, ceil(I/128)] float32: w13 and w2 are float8_e4m3fn
    block-quantized (quantization/fp8.py's served layout) and each tile is dequantised as it is loaded,
    the same arithmetic as dequantize(), so the result equals this kernel on the dequantised weights.
    fp8_activations (fp8 weights only): W8A8, x and then act quantized per row and 128-wide group
    (ops/fp8_quant.py), each K step one fp8 MMA scaled by both scales; block_k must be 128. None: W8A8
    (with pick_fp8_config's blocks) for 16-bit activations when no config is given; weight-only otherwise
    (float32 models, batch_invariant, a given config), each tile dequantised as it is loaded.
    batch_invariant: BATCH_INVARIANT_CONFIG whatever the batch. Either way the K experts' outputs are
    summed one by one in slot order (by the down GEMM's program that lands a token's last slot, or
    _sum_slots_kernel; a torch reduction may split the sum by size).
    """
    require_triton("triton_experts")
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_rows = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(x)
    if w13.stride(2) != 1 or w2.stride(2) != 1 or x.stride(1) != 1:
        raise ValueError("triton_experts: x, w13 and w2 must be contiguous in their last dimension")
    fp8 = w13_scale is not None
    auto_w8a8 = config is None and fp8 and not batch_invariant and x.dtype != torch.float32
    if auto_w8a8:
        config = pick_fp8_config(num_tokens, top_k, num_experts)
    if fp8_activations is None:
        fp8_activations = auto_w8a8
    cfg = config or (BATCH_INVARIANT_CONFIG if batch_invariant else pick_config(num_tokens, top_k, num_experts))
    if fp8 != (w2_scale is not None) or (fp8 and 128 % cfg.block_k):
        raise ValueError("triton_experts: fp8 weights need both scales and a block_k dividing 128")
    if fp8_activations and not (fp8 and cfg.block_k == 128):
        raise ValueError("triton_experts: fp8 activations need fp8 weights and block_k 128 (one scale group a step)")
    if blocks is None or blocks.block_m != cfg.block_m:
        blocks = align_to_blocks(topk_ids, num_experts, cfg.block_m)
    tiles = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=x.dtype == torch.float32,
                 UPCAST=INTERPRET, FP8_W=fp8, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    s13 = (w13_scale, w13_scale.stride(0), w13_scale.stride(1)) if fp8 else (None, 0, 0)
    s2 = (w2_scale, w2_scale.stride(0), w2_scale.stride(1)) if fp8 else (None, 0, 0)
    act = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)  # [N, I]
    a13 = fp8_operand(x if fp8_activations else None)  # W8A8: x's codes and group scales, else {}
    x_in = a13.pop("a", x)
    # gate_up: act[n] = silu(x[n // K] @ w13[e, :I].T) * (x[n // K] @ w13[e, I:].T)
    _expert_gemm_kernel[(blocks.max_blocks, triton.cdiv(inter, cfg.block_n))](
        x_in, w13, act, None, blocks.sorted_ids, blocks.block_expert, blocks.num_padded,
        num_rows, hidden, inter, x_in.stride(0), w13.stride(0), w13.stride(1), act.stride(0), *s13,
        A_ROW_DIV=top_k, GATED=True, ROUTED_WEIGHT=False, **tiles, **a13,
    )
    a2 = fp8_operand(act if fp8_activations else None)
    act_in = a2.pop("a", act)
    part = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)  # [N, H]
    weights = topk_weights.reshape(-1).float().contiguous()  # [N]
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)  # [T, H]
    n_tiles = triton.cdiv(hidden, cfg.block_n)
    # the K slots summed in order and cast by the program that lands a token's last slot (ops/arrivals.py):
    # at batch 1 on the H200 the separate sum launch cost ~2.5 us a layer; it remains where no counters are
    arrivals = arrival_counters(x.device, num_tokens * n_tiles)
    # down: part[n] = topk_weight[n] * (act[n] @ w2[e].T)
    _expert_gemm_kernel[(blocks.max_blocks, n_tiles)](
        act_in, w2, part, weights, blocks.sorted_ids, blocks.block_expert, blocks.num_padded,
        num_rows, hidden, inter, act_in.stride(0), w2.stride(0), w2.stride(1), part.stride(0), *s2,
        A_ROW_DIV=1, GATED=False, ROUTED_WEIGHT=True, **tiles,
        final_ptr=out, arrivals_ptr=arrivals, SUM_SLOTS=arrivals is not None, TOP_K=top_k, **a2,
    )  # fmt: skip
    if arrivals is None:  # the K slots summed in order and cast in one launch, the same order whatever the batch
        _sum_slots_kernel[(triton.cdiv(num_tokens * hidden, 1024),)](part, out, num_tokens, hidden, TOP_K=top_k,
                                                                      BLOCK=1024)  # fmt: skip
    return out


def fp8_operand(a: torch.Tensor | None) -> dict:
    """_expert_gemm_kernel's arguments for a W8A8 A operand: a's codes under "a", their group scales, FP8_A
    and the rounding dtype; {} for a None a (the plain operand). Also ops/fp8_linear.py's."""
    if a is None:
        return {}
    codes, scales = quantize_groups(a)
    return {"a": codes, "a_scale_ptr": scales, "stride_as": scales.stride(0), "FP8_A": True,
            "ACT_DTYPE": TL_DTYPES[a.dtype]}
