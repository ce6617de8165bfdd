"""One Triton launch per MoE layer from router logits to everything the experts and R3 need.

Shape legend: T = tokens (maybe padded for a CUDA graph), E = routed experts, K = experts per token,
G = expert groups, L = MoE layers, BT / BE / BK = T / E / K tiles, P = programs of a launch.

    router_logits [T, E] ──► scores (softmax, or sigmoid + bias + group-limited choice) ──► top-k
        ├─► topk_weights [T, K] float32  (renormalised / scaled as configured)
        ├─► topk_ids     [T, K] int64    (LOGICAL ids: what R3 records)
        ├─► counts       [E]    int32    (rows routed to each expert)
        ├─► capture buffer[t, moe_index, :] = topk_ids[t]   for every t with slot_mapping[t] >= 0
        └─► MoeBlocks (ops/moe_align.py) when block_m is given: the Triton experts' alignment

Same functions as layers/moe_routers.py's softmax_topk and grouped_sigmoid_topk (the CPU path and the reference),
with the same tie rule: among equal scores the lower expert id ranks first (torch.topk's own tie order
depends on the device and the input size, so both sides state the rule instead of inheriting it).
Probabilities are computed as torch does (max-shifted exp over the sum), so ids agree bit for bit
except where two experts' scores are within the last bits of float32 of each other (exact ties are
not such a case: equal logits give equal scores on both sides). Weights differ from torch's only by
the rounding of exp and the order of the sums (softmax denominator, renormalisation): within 1e-6
relative under the interpreter, 1e-5 on CUDA, where tl.exp is the hardware's approximate exp2.

One launch or two. With T <= ONE_LAUNCH_MAX_TOKENS (decode batches) one program routes every token
tile and then aligns: one launch per layer. Larger T spreads the routing over P programs that each
store their counts in a row of a [P, E] partial table, and a second one-program launch sums the rows
and aligns. Triton has no grid-wide barrier, and a "last program aligns" ticket would need a
zero-filled counter before every launch, which is itself a launch (a memset) and, in a persistent
buffer, a hazard the moment one launch dies half way; so the split stays where the token count makes
one program slow rather than where it is free.

No host sync anywhere: every size depends on (T, E, K, block_m) only, so a CUDA graph holds it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from fastdeploy_r3.model_executor.ops.moe_align import MoeBlocks, align_tail, max_padded_rows
from fastdeploy_r3.model_executor.ops.triton_setup import jit, pdl, pdl_prologue, require_triton, tl, triton

FUSED_ROUTING_ENV = "FDR3_FUSED_ROUTING"  # "0": the torch routers + capture kernel on every device
# H200, E=128 K=8 (bench_moe.py --routing): one launch 6.8 / 11.0 / 18.4 us a layer at T = 1 / 16 / 32,
# two launches 10.3 / 11.9 / 13.9
ONE_LAUNCH_MAX_TOKENS = 16
BLOCK_T = 16  # tokens per routing tile (fewer for a smaller batch on the one-launch path)


# warps of the one-program launch for up to FEW_TOKENS tokens (a batch-1 decode step): its top-k rounds reduce
# across fewer warps. tools/bench_r3.py, batch-1 fp8 step, pipelined, one call on the H200: 2 warps 2.58,
# 2.58 ms; 4 warps 2.61, 2.61; 1 warp 2.66, 2.67. More tokens keep 4: 2 cost batch 16 1.5 ms a step, and a
# k = 3 verify step (4 tokens, its graph's GPU time, fp8) 5.37 / 5.40 ms against 5.26 / 5.24 with 4 warps.
# Deterministic mode keeps 4 always (fused_routing's batch_invariant)
ROUTING_WARPS = 2
FEW_TOKENS = 1
# 2 to this many tokens routed without an alignment (the few-token GEMV experts, quantization/fp8.py): a
# program of ROUTING_WARPS per token, each the launch one token gets (the same reductions, so the same
# bits), and no second launch for the counts (RoutingResult.counts sums them if asked). fp8 Qwen3-30B-A3B on
# the H200, the batch-1 k = 3 verify graph in-process, two rounds: 4.407, 4.438 ms against 4.438, 4.454
PER_TOKEN_MAX_TOKENS = 4


def fused_routing_enabled() -> bool:
    """Whether MoE layers built now route through this kernel where Triton runs (the default). FDR3_FUSED_ROUTING=0
    keeps the unfused torch sequence, for comparing the two (tests/gpu/test_fused_routing_gpu.py) or ruling
    the kernel out; worker processes inherit the variable."""
    return os.environ.get(FUSED_ROUTING_ENV, "1") != "0"


@dataclass(frozen=True)
class RouterSpec:
    """How one MoE layer turns router logits into experts (the scalars of layers/moe.py's two routers).

    scoring "softmax": Qwen3-MoE (renormalize = norm_topk_prob), Mixtral (renormalize always).
    scoring "sigmoid": GLM-4.5 / DeepSeek-V3 noaux_tc: choose on sigmoid + e_score_correction_bias
    within the topk_group groups whose two best biased scores sum highest, weigh by the plain sigmoid.
    """

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"RouterSpec: scoring {self.scoring!r} is neither 'softmax' nor 'sigmoid'")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"RouterSpec: topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")


@dataclass
class RoutingResult:
    topk_weights: torch.Tensor  # [T, K] float32
    topk_ids: torch.Tensor  # [T, K] int64, logical expert ids
    # [P, E] int32: rows routed to each expert (padded tokens included: the experts run them), counted by each
    # of the launch's P programs; P = 1 wherever the kernel summed them (one program, or an alignment)
    count_rows: torch.Tensor
    blocks: MoeBlocks | None  # the alignment for block_m, when asked for

    @property
    def counts(self) -> torch.Tensor:
        """[E] int32 rows routed to each expert; summed here, on demand, where no kernel needed the sum."""
        return self.count_rows[0] if self.count_rows.shape[0] == 1 else self.count_rows.sum(0, dtype=torch.int32)


@jit
def _route_tile(
    logits_ptr, bias_ptr, t, t_ok, stride_t, num_experts, scaling, eps,
    TOP_K: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """Route BT tokens: (weights [BT, BK] float32, ids [BT, BK] int32, chosen [BT, BE] bool)."""
    e = tl.arange(0, BLOCK_E)  # [BE]
    e_ok = e < num_experts
    x = tl.load(logits_ptr + t.to(tl.int64)[:, None] * stride_t + e[None, :],
                mask=t_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)  # [BT, BE]
    if SIGMOID:
        scores = tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + tl.exp(-x))  # [BT, BE] the weights' source
        bias = tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)  # [BE]
        sel = tl.where(e_ok[None, :], scores + bias[None, :], float("-inf"))  # [BT, BE] the choice's source
        if TOPK_GROUP < N_GROUP:
            group_size = num_experts // N_GROUP
            g_of_e = e // group_size  # [BE]
            g = tl.arange(0, BLOCK_G)  # [BG]
            group_score = tl.full((t.shape[0], BLOCK_G), float("-inf"), tl.float32)  # [BT, BG]
            for gi in tl.static_range(N_GROUP):
                v = tl.where((g_of_e == gi)[None, :] & e_ok[None, :], sel, float("-inf"))  # [BT, BE]
                best = tl.max(v, axis=1)  # [BT]
                first = tl.min(tl.where(v == best[:, None], e[None, :], BLOCK_E), axis=1)  # [BT]
                second = tl.max(tl.where(e[None, :] == first[:, None], float("-inf"), v), axis=1)  # [BT]
                # the sum of the group's two best biased scores (one, for a group of one)
                s = tl.where(group_size >= 2, best + second, best)  # [BT]
                group_score = tl.where(g[None, :] == gi, s[:, None], group_score)
            keep = tl.zeros((t.shape[0], BLOCK_G), tl.int32)  # [BT, BG] 1 = group kept
            g_avail = (g < N_GROUP)[None, :] & (t >= 0)[:, None]  # [BT, BG] groups not kept yet
            for _ in tl.static_range(TOPK_GROUP):
                cand = tl.where(g_avail, group_score, float("-inf"))  # [BT, BG]
                best = tl.max(cand, axis=1)  # [BT]
                first = tl.min(tl.where(g_avail & (cand == best[:, None]), g[None, :], BLOCK_G), axis=1)  # [BT]
                keep = tl.where(g[None, :] == first[:, None], 1, keep)
                g_avail = g_avail & (g[None, :] != first[:, None])
            in_kept = tl.zeros_like(sel) > 1.0  # [BT, BE] all False
            for gi in tl.static_range(N_GROUP):
                kept = tl.sum(tl.where(g[None, :] == gi, keep, 0), axis=1) > 0  # [BT]
                in_kept = in_kept | (kept[:, None] & (g_of_e == gi)[None, :])
            sel = tl.where(in_kept, sel, float("-inf"))
    else:
        x = tl.where(e_ok[None, :], x, float("-inf"))  # [BT, BE]
        num = tl.exp(x - tl.max(x, axis=1)[:, None])  # [BT, BE]
        # softmax as torch computes it; div_rn: IEEE division (plain `/` is a 2-ulp approximation on CUDA)
        scores = tl.math.div_rn(num, tl.broadcast_to(tl.sum(num, axis=1)[:, None], num.shape))  # [BT, BE]
        sel = scores
    kk = tl.arange(0, BLOCK_K)  # [BK]
    weights = tl.zeros((t.shape[0], BLOCK_K), tl.float32)  # [BT, BK]
    ids = tl.zeros((t.shape[0], BLOCK_K), tl.int32)  # [BT, BK]
    avail = e_ok[None, :] & (t >= 0)[:, None]  # [BT, BE] experts not chosen yet
    for k in tl.static_range(TOP_K):
        cand = tl.where(avail, sel, float("-inf"))  # [BT, BE]
        best = tl.max(cand, axis=1)  # [BT]
        # the lowest expert id among the best still available (ties: lower id first; -inf rows too)
        idx = tl.min(tl.where(avail & (cand == best[:, None]), e[None, :], BLOCK_E), axis=1)  # [BT]
        idx = tl.minimum(idx, num_experts - 1)  # a NaN row picks garbage, never an id out of range
        hit = e[None, :] == idx[:, None]  # [BT, BE]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)  # [BT] the (un-biased) score of the choice
        weights = tl.where(kk[None, :] == k, w[:, None], weights)
        ids = tl.where(kk[None, :] == k, idx[:, None], ids)
        avail = avail & ~hit
    if RENORMALIZE:
        weights = tl.math.div_rn(weights, tl.broadcast_to(tl.sum(weights, axis=1)[:, None] + eps, weights.shape))
    weights = weights * scaling
    chosen = ~avail & e_ok[None, :] & t_ok[:, None]  # [BT, BE]
    return weights, ids, chosen


@jit
def _route_and_store(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, capture_ptr, slot_ptr, t0, num_tokens, num_experts, stride_t,
    stride_cap_t, stride_cap_l, moe_index, scaling, eps,
    TOP_K: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, CAPTURE: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """Route tokens [t0, t0 + BT), store weights / ids / capture rows; returns their counts [BE] int32."""
    t = t0 + tl.arange(0, BLOCK_T)  # [BT]
    t_ok = t < num_tokens
    weights, ids, chosen = _route_tile(
        logits_ptr, bias_ptr, t, t_ok, stride_t, num_experts, scaling, eps, TOP_K, SIGMOID, RENORMALIZE,
        N_GROUP, TOPK_GROUP, BLOCK_E, BLOCK_K, BLOCK_G,
    )  # fmt: skip
    kk = tl.arange(0, BLOCK_K)  # [BK]
    t64 = t.to(tl.int64)
    mask = t_ok[:, None] & (kk < TOP_K)[None, :]  # [BT, BK]
    out = t64[:, None] * TOP_K + kk[None, :]  # [BT, BK] flat rows
    tl.store(weights_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=mask)
    if CAPTURE:
        # R3: the router's LOGICAL ids, straight into the step buffer's row t (nothing after this kernel
        # may change which experts a token uses; an expert placement maps ids to slots later, in the
        # experts). A padded token (slot < 0, a CUDA graph's filler) writes nothing.
        real = t_ok
        if HAS_SLOTS:
            real = real & (tl.load(slot_ptr + t, mask=t_ok, other=-1) >= 0)
        dst = capture_ptr + t64[:, None] * stride_cap_t + moe_index * stride_cap_l + kk[None, :]
        tl.store(dst, ids.to(capture_ptr.dtype.element_ty), mask=real[:, None] & (kk < TOP_K)[None, :])
    return tl.sum(chosen.to(tl.int32), axis=0)  # [BE]


# Triton compiles one variant per class (== 1, multiple of 16, other) of every integer argument. Token
# counts, the layer index and the alignment sizes take every class within one run, so each prefill chunk
# size and layer met a compile of its own on the serving path (~4.5 s of the first rollout at 256 streams
# on the H200, py-spy); they only bound loops and masks here, so they are not specialised on.
_VARYING = ("num_tokens", "moe_index", "total_rows", "num_blocks")


@jit(do_not_specialize=_VARYING)
def _fused_routing_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, counts_ptr, capture_ptr, slot_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr, cursor_ptr,
    num_tokens, num_experts, stride_t, stride_cap_t, stride_cap_l, moe_index, scaling, eps,
    total_rows, num_blocks,
    TOP_K: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, CAPTURE: tl.constexpr, HAS_SLOTS: tl.constexpr, ONE_PROGRAM: tl.constexpr,
    ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr = False, PER_TOKEN: tl.constexpr = False,
):  # fmt: skip
    """ONE_PROGRAM: route every tile, store counts [E], align (ALIGN). Else: program p routes tile p (PER_TOKEN:
    token p) and stores its counts in row p of counts_ptr [P, BE] (the partial table _align_partials_kernel
    sums, or, PER_TOKEN, RoutingResult.counts on demand)."""
    pdl_prologue(PDL)  # the experts' kernel may start; it waits for these ids (ops/triton_setup.py)
    e = tl.arange(0, BLOCK_E)  # [BE]
    if ONE_PROGRAM:
        counts = tl.zeros((BLOCK_E,), tl.int32)  # [BE]
        for t0 in range(0, num_tokens, BLOCK_T):
            counts += _route_and_store(
                logits_ptr, bias_ptr, weights_ptr, ids_ptr, capture_ptr, slot_ptr, t0, num_tokens, num_experts,
                stride_t, stride_cap_t, stride_cap_l, moe_index, scaling, eps, TOP_K, SIGMOID, RENORMALIZE,
                N_GROUP, TOPK_GROUP, CAPTURE, HAS_SLOTS, BLOCK_T, BLOCK_E, BLOCK_K, BLOCK_G,
            )  # fmt: skip
        tl.store(counts_ptr + e, counts, mask=e < num_experts)
        if ALIGN:
            tl.debug_barrier()  # every tile's ids stored before the alignment reads them back
            align_tail(ids_ptr, counts, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, cursor_ptr,
                       num_tokens * TOP_K, num_experts, total_rows, num_blocks, BLOCK_M, BLOCK_E)
    else:
        pid = tl.program_id(0)
        t0, limit = pid * BLOCK_T, num_tokens
        if PER_TOKEN:  # token pid alone (a tile of BLOCK_T >= 2 lanes, the others masked)
            t0, limit = pid, pid + 1
        counts = _route_and_store(
            logits_ptr, bias_ptr, weights_ptr, ids_ptr, capture_ptr, slot_ptr, t0, limit,
            num_experts, stride_t, stride_cap_t, stride_cap_l, moe_index, scaling, eps, TOP_K, SIGMOID, RENORMALIZE,
            N_GROUP, TOPK_GROUP, CAPTURE, HAS_SLOTS, BLOCK_T, BLOCK_E, BLOCK_K, BLOCK_G,
        )  # fmt: skip
        tl.store(counts_ptr + pid * BLOCK_E + e, counts)


@jit(do_not_specialize=("num_programs", "num_rows", "total_rows", "num_blocks"))
def _align_partials_kernel(
    partial_ptr, ids_ptr, counts_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, cursor_ptr,
    num_programs, num_rows, num_experts, total_rows, num_blocks,
    ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Sum the [P, BE] partial counts into counts [E]; align the rows (ALIGN)."""
    e = tl.arange(0, BLOCK_E)  # [BE]
    counts = tl.zeros((BLOCK_E,), tl.int32)
    for p in range(0, num_programs):
        counts += tl.load(partial_ptr + p * BLOCK_E + e)
    tl.store(counts_ptr + e, counts, mask=e < num_experts)
    if ALIGN:
        align_tail(ids_ptr, counts, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, cursor_ptr,
                   num_rows, num_experts, total_rows, num_blocks, BLOCK_M, BLOCK_E)


def _check_args(
    router_logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None, capture_buffer: torch.Tensor | None,
    moe_index: int, slot_mapping: torch.Tensor | None,
) -> None:  # fmt: skip
    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        raise ValueError(f"fused_routing: router_logits {tuple(router_logits.shape)} must be [T, E], "
                         "contiguous along E")
    num_tokens, num_experts = router_logits.shape
    if not 1 <= spec.top_k <= num_experts:
        raise ValueError(f"fused_routing: top_k={spec.top_k} is outside [1, E={num_experts}]")
    if spec.scoring == "sigmoid":
        if bias is None or bias.shape != (num_experts,):
            raise ValueError(f"fused_routing: sigmoid scoring needs e_score_correction_bias [{num_experts}]")
        if num_experts % spec.n_group:
            raise ValueError(f"fused_routing: E={num_experts} is not divisible by n_group={spec.n_group}")
    if capture_buffer is not None:
        if capture_buffer.dim() != 3 or capture_buffer.shape[2] != spec.top_k or capture_buffer.stride(2) != 1:
            raise ValueError(f"fused_routing: capture buffer {tuple(capture_buffer.shape)} is not a "
                             f"[max_tokens, L, {spec.top_k}] tensor contiguous along K")
        if capture_buffer.device != router_logits.device:
            raise ValueError(f"fused_routing: the capture buffer is on {capture_buffer.device}, the logits on "
                             f"{router_logits.device}")
        if not 0 <= moe_index < capture_buffer.shape[1] or num_tokens > capture_buffer.shape[0]:
            raise ValueError(f"fused_routing: layer {moe_index} / {num_tokens} tokens do not fit the capture "
                             f"buffer {tuple(capture_buffer.shape)}")
    if slot_mapping is not None and slot_mapping.shape != (num_tokens,):
        raise ValueError(f"fused_routing: slot_mapping {tuple(slot_mapping.shape)} is not [{num_tokens}]")


def fused_routing(
    router_logits: torch.Tensor,
    spec: RouterSpec,
    e_score_correction_bias: torch.Tensor | None = None,
    capture_buffer: torch.Tensor | None = None,
    moe_index: int = 0,
    slot_mapping: torch.Tensor | None = None,
    block_m: int | None = None,
    one_launch: bool | None = None,
    batch_invariant: bool = False,
) -> RoutingResult:
    """router_logits [T, E] (any float dtype) -> RoutingResult, plus the R3 capture write.

    capture_buffer [max_tokens, L, K] (the routing capture's step buffer, any integer dtype) receives
    row t = topk_ids[t] in layer moe_index for every token whose slot_mapping[t] >= 0 (all T without a
    slot_mapping). block_m: also align the rows for the Triton experts (ops/fused_moe_triton.py).
    one_launch forces the one-program path (True) or the two-launch path (False); None picks by T, and routes
    2 to PER_TOKEN_MAX_TOKENS tokens without block_m in a program per token.
    batch_invariant (deterministic mode): the launch's warps never depend on T (see ROUTING_WARPS).
    """
    require_triton("fused_routing")
    _check_args(router_logits, spec, e_score_correction_bias, capture_buffer, moe_index, slot_mapping)
    num_tokens, num_experts = router_logits.shape
    dev, top_k = router_logits.device, spec.top_k
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev)  # [T, K]
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=dev)  # [T, K]
    num_rows = num_tokens * top_k
    blocks = None
    if block_m is not None:
        total = max_padded_rows(num_rows, num_experts, block_m)
        blocks = MoeBlocks(
            sorted_ids=torch.empty(total, dtype=torch.int32, device=dev),  # [P]
            block_expert=torch.empty(total // block_m, dtype=torch.int32, device=dev),  # [NB]
            num_padded=torch.empty(1, dtype=torch.int32, device=dev),
            block_m=block_m,
        )
    if num_tokens == 0:
        if blocks is not None:
            blocks.num_padded.zero_()
        return RoutingResult(weights, ids, torch.zeros(1, num_experts, dtype=torch.int32, device=dev), blocks)
    block_e = triton.next_power_of_2(num_experts)
    cursor = torch.empty(block_e, dtype=torch.int32, device=dev)  # scratch of the alignment
    sigmoid = spec.scoring == "sigmoid"
    align = (blocks.sorted_ids, blocks.block_expert, blocks.num_padded) if blocks else (cursor, cursor, cursor)
    sizes = (blocks.sorted_ids.shape[0], blocks.block_expert.shape[0]) if blocks else (0, 0)
    per_token = (one_launch is None and blocks is None and not batch_invariant
                 and FEW_TOKENS < num_tokens <= PER_TOKEN_MAX_TOKENS)  # fmt: skip
    one = not per_token and (num_tokens <= ONE_LAUNCH_MAX_TOKENS if one_launch is None else one_launch)
    # a decode batch of a few tokens takes a tile its size (>= 2: no one-lane tiles), not 16 mostly-masked rows
    block_t = 2 if per_token else BLOCK_T if not one else max(2, min(BLOCK_T, triton.next_power_of_2(num_tokens)))
    programs = 1 if one else num_tokens if per_token else triton.cdiv(num_tokens, BLOCK_T)
    early = pdl(router_logits)
    # deterministic mode keeps 4 warps at every batch size: a row's reductions then never change their order
    warps = ROUTING_WARPS if (num_tokens <= FEW_TOKENS or per_token) and not batch_invariant else 4
    # [E] summed by the kernel(s), or per_token's [P, BE] rows, which RoutingResult.counts sums if asked
    counts = None if per_token else torch.empty(num_experts, dtype=torch.int32, device=dev)
    partial = counts if one else torch.empty(programs, block_e, dtype=torch.int32, device=dev)  # [P, BE]
    _fused_routing_kernel[(programs,)](
        router_logits, e_score_correction_bias if sigmoid else router_logits, weights, ids, partial,
        ids if capture_buffer is None else capture_buffer, ids if slot_mapping is None else slot_mapping,
        *align, cursor, num_tokens, num_experts, router_logits.stride(0),
        0 if capture_buffer is None else capture_buffer.stride(0),
        0 if capture_buffer is None else capture_buffer.stride(1), moe_index,
        float(spec.routed_scaling_factor), 1e-20 if sigmoid else 0.0, *sizes,
        TOP_K=top_k, SIGMOID=sigmoid, RENORMALIZE=spec.renormalize, N_GROUP=spec.n_group,
        TOPK_GROUP=spec.topk_group, CAPTURE=capture_buffer is not None, HAS_SLOTS=slot_mapping is not None,
        ONE_PROGRAM=one, ALIGN=blocks is not None, BLOCK_M=block_m or 1, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_G=triton.next_power_of_2(spec.n_group),
        PDL=early, launch_pdl=early, num_warps=warps, PER_TOKEN=per_token,
    )  # fmt: skip
    if per_token:
        return RoutingResult(weights, ids, partial[:, :num_experts], blocks)
    if not one:
        _align_partials_kernel[(1,)](
            partial, ids, counts, *align, cursor, programs, num_rows, num_experts, *sizes,
            ALIGN=blocks is not None, BLOCK_M=block_m or 1, BLOCK_E=block_e, num_warps=4,
        )  # fmt: skip
    return RoutingResult(weights, ids, counts.view(1, num_experts), blocks)
