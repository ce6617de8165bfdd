"""W8A8 GEMV: the fp8 dense linear of one row, the fused MoE of 1 to 4 tokens (a batch-1 decode step, a
batch-1 verify step's k + 1 tokens, a tiny batch).

At one row the tile kernel (ops/fused_moe_triton.py's _expert_gemm_kernel) spends a 16-row MMA on one
useful row, streams 2 KB tiles and needs a quantization launch before each GEMM; on the H200 it read
Qwen3-30B-A3B's fp8 weights at 16-40 % of copy bandwidth. Here a program owns BLOCK_N output rows of W
and walks K in BLOCK_K steps (several 128-wide scale groups at once), multiplying on the CUDA cores:

    y[n] = sum_g (sum_{k in g} a_code[k] * w_code[n, k]) * a_scale[g] * w_scale[n, g]

The operands are the tile kernel's W8A8 operands: the activation quantized per 128-wide group exactly as
ops/fp8_quant.py quantizes it, but here as it is loaded (no launch of its own: one launch per linear, two
per MoE), and the weight's codes and scale rows. Each product of two e4m3 values is exact in float32; only
the summation order differs from the MMA's, so a row computed here and by the tile kernel agree to float32
rounding, and each output is rounded to the model dtype at the same points as there:

    DENSE   y = W a                                      (ops/fp8_linear.py)
    GATED   act[t, k] = silu(W13[e_tk, :I] x[t]) * (W13[e_tk, I:] x[t]), one program per token slot (t, k)
            and BLOCK_N of I
    DOWN    out[t] = sum_k topk_weight[t, k] * (W2[e_tk] act[t, k]), one program per token slot and BLOCK_N
            of H; a token's slots added in order by the last of its tile's programs to land (ops/arrivals.py)

Slots whose expert is not on this rank (id >= E) contribute nothing (their act rows are zeros). A token's
programs never read another token's rows, so its result is the one it gets alone. Two tokens that route to
one expert read its rows twice (the tile kernel reads them once); at 4 tokens that is ~10 % more bytes under
uniform routing, and still the faster kernel (quantization/fp8.py GEMV_MOE_MAX_TOKENS says by how much).

Launched early where PDL runs (ops/triton_setup.py): DENSE and DOWN ask L2 for their weight rows, then
wait for the kernel before them (DOWN reads its slot's expert id first: the routing finished before
GATED let DOWN launch); GATED waits at once (its ids are the routing's output). A weight that is never
written during a step streams while the norm, the attention or GATED before it still runs.

fp8_gemv_normed_linear: the decoder layer's input RMSNorm (and its residual add) in the qkv GEMV's loads,
one launch less: every program computes the row's 1 / rms itself (ops/rms_norm.py's row_inv_rms, the norm
kernel's arithmetic: the same bits), the first writes the sum, the next residual.

Weights are loaded evict-first (EXPERT_EVICT, DENSE_EVICT): read once a step, they no longer push the rows
a kernel launched early prefetched out of L2.

tools/bench_fp8.py --modes gemv, 48 layers on the H200 (ms; the tile kernels with their quantization
launches, then cuBLAS on bf16 weights): qkv 0.34 (0.47, 0.38), o 0.33 (0.61, 0.45), experts 1.05 (1.14,
1.27 for the bf16 Triton MoE). The batch-1 engine step went from 3.86 to 3.26 ms pipelined; with the
early launches (and the router gate's GEMV, ops/gemv.py) to 2.70 ms; with both norms fused into the
GEMVs after them, the loads evict-first and the routing in 2 warps to 2.51-2.56 ms (docs/perf_h200.md).
"""

from __future__ import annotations

import torch

from fastdeploy_r3.model_executor.ops.arrivals import arrival_counters, ordered_sum
from fastdeploy_r3.model_executor.ops.fp8_quant import GROUP, TL_DTYPES, e4m3_round, group_quotients
from fastdeploy_r3.model_executor.ops.fused_moe_triton import _sum_slots_kernel
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

DENSE, GATED, DOWN = 0, 1, 2


@jit
def _gemv_rows(a_ptr, w_ptr, w_scale_ptr, n, n_ok, red_dim, stride_wn, stride_sn, up_rows,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UP: tl.constexpr, PREFETCH: tl.constexpr,
               ROW_CHUNKS: tl.constexpr, EVICT: tl.constexpr, NORM: tl.constexpr, residual_ptr, norm_weight_ptr,
               sum_out_ptr, eps, NORM_BLOCK: tl.constexpr):  # fmt: skip
    """([BLOCK_N], [BLOCK_N]) float32: rows n (and with UP rows up_rows + n, loaded in the same K step so
    that both are in flight at once) of one fp8 weight (w_ptr, its scale rows w_scale_ptr) times one
    16-bit row a_ptr, quantized here per 128-wide group with ops/fp8_quant.py's own arithmetic
    (group_quotients, then e4m3_round), each group's float32 sum scaled by both scales.

    PREFETCH: the kernel was launched early (ops/triton_setup.py); the rows are prefetched into L2 first
    (weights are never written during a step), then it waits for the kernel before it to finish.
    EVICT: the weight loads' L2 eviction policy ("evict_first" for weights read once a step).
    NORM: the RMSNorm (weight norm_weight_ptr, eps) of a_ptr's row plus residual_ptr's, which ops/rms_norm.py
    would run before this GEMV, applied to the row as it is loaded; the grid's first program writes the sum
    (the next residual) to sum_out_ptr."""
    if PREFETCH:
        prefetch_rows(w_ptr, n, n_ok, red_dim, stride_wn, ROW_CHUNKS, 32)  # fp8: 32 codes a sector
        wait_for_inputs(PREFETCH)
    if NORM:
        inv_rms = row_inv_rms(a_ptr, residual_ptr, red_dim, eps, NORM_BLOCK)
    g = tl.arange(0, BLOCK_K // 128)  # [G]
    j = tl.arange(0, 128)  # [128]
    rows = n[:, None, None].to(tl.int64) * stride_wn  # [BN, 1, 1]
    s_rows = w_scale_ptr + n[:, None].to(tl.int64) * stride_sn  # [BN, 1]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, red_dim, BLOCK_K):
        k = k0 + g[:, None] * 128 + j[None, :]  # [G, 128]
        k_ok = k < red_dim
        w_mask = n_ok[:, None, None] & k_ok[None, :, :]
        w = tl.load(w_ptr + rows + k[None, :, :], mask=w_mask, other=0.0, eviction_policy=EVICT)  # [BN, G, 128]
        if UP:
            wu = tl.load(w_ptr + up_rows * stride_wn + rows + k[None, :, :], mask=w_mask, other=0.0,
                         eviction_policy=EVICT)  # fmt: skip
        v = tl.load(a_ptr + k, mask=k_ok, other=0.0)  # [G, 128] 16-bit
        if NORM:
            v, total = normed_elements(v, k, k_ok, inv_rms, residual_ptr, norm_weight_ptr)
            if tl.program_id(0) == 0:  # the first program writes the sum: the next residual
                tl.store(sum_out_ptr + k, total, mask=k_ok)
        v = v.to(tl.float32)
        a_s, a = group_quotients(v)  # [G] scales, [G, 128] quotients
        a = e4m3_round(a)  # the codes' values
        grp = k0 // 128 + g  # [G]
        s_mask = n_ok[:, None] & (grp * 128 < red_dim)[None, :]
        w_s = tl.load(s_rows + grp[None, :], mask=s_mask, other=0.0)  # [BN, G]
        acc += tl.sum(tl.sum(w.to(tl.float32) * a[None, :, :], axis=2) * w_s * a_s[None, :], axis=1)
        if UP:
            u_s = tl.load(s_rows + up_rows * stride_sn + grp[None, :], mask=s_mask, other=0.0)  # [BN, G]
            acc_up += tl.sum(tl.sum(wu.to(tl.float32) * a[None, :, :], axis=2) * u_s * a_s[None, :], axis=1)
    return acc, acc_up


@jit
def _fp8_gemv_kernel(
    a_ptr,  # 16-bit: DENSE one row [red_dim]; GATED the tokens' rows [T, red_dim]; DOWN the slots' [T * K, red_dim]
    w_ptr,  # DENSE [O, red_dim]; GATED w13 [E, 2I, H]; DOWN w2 [E, H, I]; fp8 codes
    w_scale_ptr,  # the weight's scale rows [.., rows, ceil(red_dim / 128)] float32
    out_ptr,  # DENSE [O]; GATED act [T * K, I]; DOWN [T, H]; the model dtype
    ids_ptr,  # GATED / DOWN: topk_ids [T * K], flat slot s = t * K + k
    topk_weights_ptr,  # DOWN: [T * K]
    part_ptr,  # DOWN: [T * K, H] float32, each slot's weighted output
    arrivals_ptr,  # DOWN with SUM_SLOTS: [T, grid n] int32 counters, zero between launches (ops/arrivals.py)
    num_experts,
    out_cols,  # DENSE O; GATED I; DOWN H
    red_dim,
    stride_a,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    MODE: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACT_DTYPE: tl.constexpr,
    SUM_SLOTS: tl.constexpr = False,
    PDL: tl.constexpr = False,
    ROW_CHUNKS: tl.constexpr = 1,
    EVICT: tl.constexpr = "",
    residual_ptr=None,  # DENSE with NORM: the residual row [red_dim] added to a_ptr's row before the norm
    norm_weight_ptr=None,  # DENSE with NORM: the RMSNorm's weight [red_dim]
    sum_out_ptr=None,  # DENSE with NORM: the sum's row [red_dim], written by the first program
    eps=0.0,
    NORM: tl.constexpr = False,
    NORM_BLOCK: tl.constexpr = 1,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = n < out_cols
    if MODE != 1:  # DENSE, DOWN: the small kernel after this one may launch (it waits for this one)
        let_dependents_launch(PDL)
    if MODE == 0:  # DENSE
        y, _ = _gemv_rows(a_ptr, w_ptr, w_scale_ptr, n, n_ok, red_dim, stride_wn, stride_sn, 0, BLOCK_N, BLOCK_K,
                          False, PDL, ROW_CHUNKS, EVICT, NORM, residual_ptr, norm_weight_ptr, sum_out_ptr, eps,
                          NORM_BLOCK)  # fmt: skip
        tl.store(out_ptr + n, y.to(ACT_DTYPE), mask=n_ok)
    else:  # GATED / DOWN: one slot of one token a program
        slot = tl.program_id(1)  # flat: token slot // TOP_K, its slot slot % TOP_K
        if MODE == 1:
            # GATED follows the routing kernel that writes the ids: wait for it, then let DOWN launch (DOWN may
            # then read the ids before its own wait, and stream its experts' weights while this one runs)
            wait_for_inputs(PDL)
            let_dependents_launch(PDL)
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        valid = expert < num_experts
        expert = tl.where(valid, expert, 0)  # a foreign expert's slot reads expert 0 and stores zeros
        w = w_ptr + expert * stride_we
        s = w_scale_ptr + expert * stride_se
        if MODE == 1:  # GATED: its expert's gate rows n and up rows I + n
            gate, up = _gemv_rows(a_ptr + (slot // TOP_K) * stride_a, w, s, n, n_ok, red_dim, stride_wn, stride_sn,
                                  out_cols, BLOCK_N, BLOCK_K, True, False, ROW_CHUNKS, EVICT, False, a_ptr, a_ptr,
                                  a_ptr, 0.0, 1)  # fmt: skip
            # both rounded as the tile kernel rounds its linear outputs
            gate = tl.where(valid, gate, 0.0).to(ACT_DTYPE).to(tl.float32)
            up = up.to(ACT_DTYPE).to(tl.float32)
            tl.store(out_ptr + slot * out_cols + n, (gate * tl.sigmoid(gate) * up).to(ACT_DTYPE), mask=n_ok)
        else:  # DOWN: the slot's weighted output; the last slot program of a tile to land sums all, in slot order
            y, _ = _gemv_rows(a_ptr + slot * stride_a, w, s, n, n_ok, red_dim, stride_wn, stride_sn, 0, BLOCK_N,
                              BLOCK_K, False, PDL, ROW_CHUNKS, EVICT, False, a_ptr, a_ptr, a_ptr, 0.0,
                              1)  # fmt: skip
            weight = tl.where(valid, tl.load(topk_weights_ptr + slot), 0.0)
            tl.store(part_ptr + slot * out_cols + n, y.to(ACT_DTYPE).to(tl.float32) * weight, mask=n_ok)
            if SUM_SLOTS:
                tl.debug_barrier()  # this program's part stores come before its arrival
                token = slot // TOP_K
                arrival = arrivals_ptr + token * tl.num_programs(0) + tl.program_id(0)
                if tl.atomic_add(arrival, 1, sem="acq_rel") == TOP_K - 1:
                    tl.store(arrival, 0)  # zero again for the next launch
                    # the token's slots in slot order, from its slot 0's row
                    total = ordered_sum(part_ptr + token * TOP_K * out_cols + n, out_cols, TOP_K, n_ok)
                    tl.store(out_ptr + token * out_cols + n, total.to(ACT_DTYPE), mask=n_ok)


# (BLOCK_N, BLOCK_K, num_warps) of the MoE's launches. tools/bench_fp8.py --modes gemv on the H200 (launched
# back to back, no prefetch): (16, 512, 4) both, 1.05 ms for 48 layers, the tile kernels 1.14. In the
# engine step, where DOWN prefetches while GATED runs, DOWN with (32, 256, 4) took the batch-1 fp8 step
# (tools/bench_r3.py, pipelined) from 2.78 to 2.70 ms, three runs each; (32, 128, 4) 2.85; GATED
# (8, 512, 4) with DOWN (8, 256, 4) 2.99
GEMV_TILES = {GATED: (16, 512, 4), DOWN: (32, 256, 4)}
# L2 eviction policy of the weight loads. Every weight is read once a step: marked evict-first, the experts'
# no longer push out of L2 the rows DOWN prefetched while GATED runs (tools/bench_r3.py, batch-1 fp8 step,
# pipelined, one call on the H200: 2.65 ms against 2.71 twice; the dense linears' too: 2.61, 2.62, 2.61
# against 2.63, 2.63 with the input norm fused)
EXPERT_EVICT = "evict_first"
DENSE_EVICT = "evict_first"


def _dense_tiles(in_features: int) -> tuple[int, int, int]:
    """8 rows a program, the K loop in two steps (tools/bench_fp8.py --modes gemv on the H200, 48 layers of
    Qwen3-30B-A3B: qkv 2048 -> 5120 0.342 ms with (8, 1024, 4), o 4096 -> 2048 0.330 ms with (8, 2048, 8);
    the W8A8 tile kernel with its quantization launch 0.470 / 0.614, cuBLAS bf16 0.383 / 0.452)."""
    block_k = min(2048, max(GROUP, triton.next_power_of_2(in_features) // 2))
    return 8, block_k, 8 if block_k >= 2048 else 4


def _launch(mode: int, grid: tuple[int, ...], a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
            out: torch.Tensor, tiles: tuple[int, int, int] | None, out_cols: int, red_dim: int, num_experts: int = 1,
            ids: torch.Tensor | None = None, weights: torch.Tensor | None = None, part: torch.Tensor | None = None,
            top_k: int = 1, num_tokens: int = 1,
            norm: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor] | None = None) -> None:  # fmt: skip
    block_n, block_k, warps = tiles or (_dense_tiles(red_dim) if mode == DENSE else GEMV_TILES[mode])
    if block_k % GROUP:
        raise ValueError(f"fp8 GEMV: BLOCK_K {block_k} must be a multiple of {GROUP} (whole scale groups)")
    if a.stride(-1) != 1 or w.stride(-1) != 1 or w_scale.stride(-1) != 1:
        raise ValueError("fp8 GEMV: activations, weights and scale rows must be contiguous in their last dimension")
    tiles_n = triton.cdiv(out_cols, block_n)
    arrivals = arrival_counters(a.device, num_tokens * tiles_n) if mode == DOWN else None
    expert_strides = (w.stride(0), w_scale.stride(0)) if mode != DENSE else (0, 0)
    # launched early (ops/triton_setup.py): DENSE and DOWN prefetch their weight rows into L2 before they
    # wait for the activations; GATED waits for the routing at once
    use_pdl = pdl(a)
    norm_args = {}
    if norm is not None:  # DENSE after an RMSNorm: (residual, norm weight, eps, the sum's output row)
        residual, norm_weight, eps, sum_out = norm
        norm_args = dict(residual_ptr=residual, norm_weight_ptr=norm_weight, sum_out_ptr=sum_out, eps=eps, NORM=True,
                         NORM_BLOCK=triton.next_power_of_2(red_dim))  # fmt: skip
    _fp8_gemv_kernel[(tiles_n, *grid)](
        a, w, w_scale, out, ids, weights, part, arrivals, num_experts, out_cols, red_dim,
        a.stride(0), expert_strides[0], w.stride(-2), expert_strides[1], w_scale.stride(-2),
        MODE=mode, TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k, ACT_DTYPE=TL_DTYPES[a.dtype],
        SUM_SLOTS=arrivals is not None, PDL=use_pdl, ROW_CHUNKS=triton.next_power_of_2(triton.cdiv(red_dim, 32)),
        EVICT=DENSE_EVICT if mode == DENSE else EXPERT_EVICT, num_warps=warps, launch_pdl=use_pdl, **norm_args,
    )  # fmt: skip
    if mode == DOWN and arrivals is None:  # no counters (first call under graph capture): the slots in one launch
        _sum_slots_kernel[(triton.cdiv(num_tokens * out_cols, 1024),)](part, out, num_tokens, out_cols, TOP_K=top_k,
                                                                        BLOCK=1024)  # fmt: skip


def fp8_gemv_linear(x: torch.Tensor, weight: torch.Tensor, scale_rows: torch.Tensor,
                    tiles: tuple[int, int, int] | None = None) -> torch.Tensor:  # fmt: skip
    """x [1, I] (16-bit) @ weight [O, I] fp8 (scale rows [O, ceil(I/128)]) -> [1, O] in x.dtype: x quantized
    per 128-wide group as it is loaded, ops/fp8_linear.py's W8A8 arithmetic for one row, one launch."""
    require_triton("fp8_gemv_linear")
    out_features, in_features = weight.shape
    _check_one_row("fp8_gemv_linear", x, in_features)
    out = torch.empty(1, out_features, dtype=x.dtype, device=x.device)
    _launch(DENSE, (), x, weight, scale_rows, out, tiles, out_features, in_features)
    return out


def fp8_gemv_normed_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           weight: torch.Tensor, scale_rows: torch.Tensor,
                           tiles: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The RMSNorm before a linear fused into its GEMV: s = x + residual (both [1, I], 16-bit), then
    rms_norm(s, norm_weight, eps) @ weight [O, I] fp8 -> ([1, O], s), in one launch instead of two. Each
    program normalizes the row itself as it loads it (ops/rms_norm.py's roundings); the first writes s."""
    require_triton("fp8_gemv_normed_linear")
    out_features, in_features = weight.shape
    _check_one_row("fp8_gemv_normed_linear", x, in_features)
    if (residual.shape != x.shape or residual.stride(-1) != 1 or norm_weight.shape != (in_features,)
            or norm_weight.dtype != x.dtype):  # fmt: skip
        raise ValueError(f"fp8_gemv_normed_linear: residual {tuple(residual.shape)} must match x {tuple(x.shape)} "
                         f"and norm_weight {tuple(norm_weight.shape)} {norm_weight.dtype} be [{in_features}] "
                         f"{x.dtype}")  # fmt: skip
    out = torch.empty(1, out_features, dtype=x.dtype, device=x.device)
    total = torch.empty_like(x)
    _launch(DENSE, (), x, weight, scale_rows, out, tiles, out_features, in_features,
            norm=(residual, norm_weight, eps, total))  # fmt: skip
    return out, total


def _check_one_row(name: str, x: torch.Tensor, in_features: int) -> None:
    """The dense GEMV takes one row. At a verify step's 4 rows, a GEMV that loads each weight tile once for
    all rows (quantizing every row in each of its programs) made the verify step 1.1-3.6 ms slower than the
    split-K tile kernels, and one with a program per (tile, row) 0.77 ms slower: a row costs what the
    one-row launch costs, bound by its own conversions and FMAs rather than by HBM (docs/perf_h200.md)."""
    if x.dim() != 2 or x.shape != (1, in_features):
        raise ValueError(f"{name}: x {tuple(x.shape)} must be one row of {in_features}; more rows take "
                         "ops/fp8_linear.py")


def fp8_gemv_experts(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                     w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     tiles: dict[int, tuple[int, int, int]] | None = None) -> torch.Tensor:  # fmt: skip
    """The W8A8 fused MoE of a few tokens (ops/fused_moe_triton.py's arithmetic), two launches: x [T, H]
    (16-bit); w13 [E, 2I, H], w2 [E, H, I] fp8 with their scale rows; topk_weights / topk_ids [T, K] -> [T, H]
    in x.dtype. x's rows, then each slot's intermediate [I], are quantized per 128-wide group as they are
    loaded; a program per (output tile, token slot), a token's K slots summed in slot order by the tile's last
    one to land. Two tokens that share an expert each read its rows (the tile kernel reads them once)."""
    require_triton("fp8_gemv_experts")
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    num_tokens, top_k = topk_ids.shape
    if x.dim() != 2 or x.shape != (num_tokens, hidden) or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fp8_gemv_experts: x {tuple(x.shape)} must be [{num_tokens}, {hidden}] and topk_weights "
                         f"{tuple(topk_weights.shape)} match topk_ids {tuple(topk_ids.shape)}")  # fmt: skip
    slots = num_tokens * top_k
    ids = topk_ids.reshape(-1).contiguous()  # [T * K]
    tiles = tiles or {}
    act = torch.empty(slots, inter, dtype=x.dtype, device=x.device)  # [T * K, I]
    _launch(GATED, (slots,), x, w13, w13_scale, act, tiles.get(GATED), inter, hidden, num_experts, ids, top_k=top_k)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    part = torch.empty(slots, hidden, dtype=torch.float32, device=x.device)  # [T * K, H]
    weights = topk_weights.reshape(-1).float().contiguous()
    _launch(DOWN, (slots,), act, w2, w2_scale, out, tiles.get(DOWN), hidden, inter, num_experts, ids, weights, part,
            top_k, num_tokens)  # fmt: skip
    return out
