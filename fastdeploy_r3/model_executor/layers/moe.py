"""MoE block: router variants (the same on every device) + routed experts (loop on the CPU, fused on CUDA).

Shape legend: T = tokens, H = hidden size, E = routed experts, K = experts per token,
I = expert intermediate size, G = expert groups.

Right after top-k the layer reports its LOGICAL expert ids [T, K] to the forward context's routing
capture (R3); nothing after that point may change which experts a token uses. Where Triton runs (CUDA,
or the interpreter) route_fused() does routing, the capture write and the experts' alignment in one
kernel (ops/fused_routing.py); route() and the capture call are the CPU path and the reference.

Expert parallel over the same N ranks (--enable-expert-parallel): each rank holds E/N whole experts
(expert_placement.py) and runs only the (token, k) rows routed to them (expert_dispatch.py); the same
all-reduce sums the ranks' contributions.

Tensor parallel over N ranks: the router is replicated (every rank picks the same experts from the
same input, so any rank's R3 rows are every rank's); each expert is split on I, w13 by rows and w2 by
columns, so rank r computes a partial sum over its I/N and the block does one all-reduce of the
routed + shared experts' output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastdeploy_r3.distributed.parallel_state import all_reduce
from fastdeploy_r3.model_executor.batch_invariant import invariant_rows, linear
from fastdeploy_r3.model_executor.forward_context import RoutingCaptureSink, get_forward_context
from fastdeploy_r3.model_executor.layers.expert_dispatch import ExpertDispatch, LocalDispatch
from fastdeploy_r3.model_executor.layers.expert_placement import ExpertPlacement, ExpertPlacementError
from fastdeploy_r3.model_executor.layers.fused_moe import choose_backend, grouped_mm_experts
from fastdeploy_r3.model_executor.layers.linear import divide
from fastdeploy_r3.model_executor.layers.mlp import GatedMLP
from fastdeploy_r3.model_executor.layers.moe_routers import grouped_sigmoid_topk, softmax_topk
from fastdeploy_r3.model_executor.ops.fused_moe_triton import BATCH_INVARIANT_CONFIG, pick_config, triton_experts
from fastdeploy_r3.model_executor.ops.fused_routing import (
    RouterSpec,
    RoutingResult,
    fused_routing,
    fused_routing_enabled,
)
from fastdeploy_r3.model_executor.ops.gemv import normed_gemv, router_gate, use_one_row_gemv
from fastdeploy_r3.model_executor.ops.moe_align import MoeBlocks
from fastdeploy_r3.model_executor.ops.triton_setup import use_triton
from fastdeploy_r3.model_executor.quantization import MoEMethod, moe_method

# a batch-1 step's post-attention RMSNorm inside the router gate's GEMV (SparseMoeBlock.forward_normed):
# tools/bench_r3.py, batch-1 fp8 step, pipelined, one call on the H200: 2.52, 2.51 ms against 2.56, 2.56
FUSED_GATE_NORM = True
# ... and up to this many rows (a batch-1 verify step; ops/gemv.py normed_gemv: a grid column per row). fp8
# Qwen3-30B-A3B on the H200, the batch-1 k = 3 verify graph in-process, two rounds: 4.367, 4.385 ms against
# 4.438, 4.454 with the norm's own launch
FUSED_GATE_NORM_MAX_ROWS = 4


def loop_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """The reference: a Python loop over the experts that received tokens (host syncs: CPU path only).

    x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K], topk_ids [T, K] -> [T, H]. Memory stays
    O(T * H), unlike gathering [T, K, 2I, H]. A token's experts add into it in ascending expert id order
    whatever the batch; batch_invariant: the GEMMs too are row-invariant (model_executor/batch_invariant.py),
    so a token's result does not depend on how many others the same expert receives.
    """
    out = torch.zeros_like(x)  # [T, H]
    for e in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == e)  # [n], [n]
        gate, up = linear(x[token_idx], w13[e], batch_invariant=batch_invariant).chunk(2, dim=-1)  # [n, I] x2
        y = linear(invariant_rows(F.silu, gate, batch_invariant) * up, w2[e], batch_invariant=batch_invariant)  # [n, H]
        y = y * topk_weights[token_idx, slot, None].to(y.dtype)  # [n, H]
        out.index_add_(0, token_idx, y)
    return out


class StackedExperts(nn.Module):
    """The SwiGLU experts `placement` gives this rank, stored stacked (the layout the fused kernels read):
    w13[slot] = [gate; up], w2[slot] = down, for each slot in placement.local_slots(expert).

    `backend` ("auto" by default; see fused_moe.BACKENDS) says how forward() computes them.

    With N ranks, I below is this rank's I/N: w13[e] = [gate[r-th I/N rows]; up[r-th I/N rows]] and
    w2[e] = down[:, r-th I/N columns]; forward() then returns this rank's partial sum.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        placement: ExpertPlacement | None = None,
        quant_method: MoEMethod | None = None,
    ) -> None:
        super().__init__()
        self.placement = placement or ExpertPlacement.identity(num_experts)
        if self.placement.num_experts != num_experts:
            raise ExpertPlacementError(
                f"the placement maps {self.placement.num_experts} experts, the layer has {num_experts}"
            )
        self.num_experts = num_experts  # logical E, what the router picks from
        # None: slot e is expert e, topk_ids index the weights directly; else the expert-parallel dispatch
        self.dispatch: ExpertDispatch | None = None if self.placement.is_identity else LocalDispatch(self.placement)
        self.tp_rank = tp_rank
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = divide(intermediate_size, tp_size, "expert intermediate size")
        self.quant_method = quant_method or moe_method()
        # w13 [E_local, 2I, H], w2 [E_local, H, I]: one slot per expert this rank holds, in the
        # method's format (model_executor/quantization/)
        self.quant_method.create_weights(self, self.placement.num_local_experts, hidden_size, self.intermediate_size)
        self.backend = "auto"
        # fixed-tile expert GEMMs (model_executor/batch_invariant.py): the loop on the CPU; on CUDA the
        # Triton kernel with one tile config for every batch size
        self.batch_invariant = False

    def load_expert(self, expert: int, proj: str, full: torch.Tensor, param: str = "weight") -> None:
        """Copy this rank's slice of logical `expert`'s checkpoint tensor into its slot:
        proj "gate"/"up" [I_full, H], "down" [H, I_full]. param "weight_scale_inv": an fp8 layer's scale,
        rows already expanded (quantization/fp8.py), into w13_weight_scale_inv / w2_weight_scale_inv."""
        slots = self.placement.local_slots(expert)  # several under EPLB: each replica gets the same weights
        if not slots:
            raise ExpertPlacementError(f"expert {expert} is held by rank {self.placement.expert_rank[expert]}, "
                                       f"not by rank {self.placement.ep_rank}: skip its weights")
        inter = self.intermediate_size
        start = self.tp_rank * inter
        suffix = "" if param == "weight" else "_" + param
        w13, w2 = getattr(self, "w13" + suffix), getattr(self, "w2" + suffix)
        for slot in slots:
            if proj == "gate":
                w13[slot, :inter].copy_(full[start : start + inter])
            elif proj == "up":
                w13[slot, inter:].copy_(full[start : start + inter])
            else:
                assert proj == "down", proj
                cols = w2.shape[2]  # I, or a scale's ceil(I/128) (a multiple of 128 per rank under TP)
                first = self.tp_rank * cols
                w2[slot].copy_(full[:, first : first + cols])

    def triton_block_m(self, x: torch.Tensor, top_k: int) -> int | None:
        """The block of rows the Triton backend will align this batch to (so the routing kernel can align
        for it), or None where another backend will run it."""
        if not self.placement.is_identity or choose_backend(self.backend, x, self.batch_invariant) != "triton":
            return None
        if not self.quant_method.uses_alignment(self, x):
            return None
        if self.batch_invariant:
            return BATCH_INVARIANT_CONFIG.block_m
        return pick_config(x.shape[0], top_k, self.num_experts).block_m

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                blocks: MoeBlocks | None = None) -> torch.Tensor:  # fmt: skip
        """x [T, H], topk_weights [T, K], topk_ids [T, K] logical ids -> [T, H], through the quantization method.

        blocks: topk_ids already aligned (by the fused routing kernel) for the Triton backend, if it runs."""
        if self.dispatch is not None:
            # expert parallel: the backends index w13 / w2 by slot, so only this rank's rows, as slots, reach them
            rows = self.dispatch.dispatch(x, topk_weights, topk_ids)
            if rows.x.shape[0] == 0:  # no token chose one of this rank's experts; combine() still runs (an
                y = x.new_zeros(0, x.shape[1])  # all-to-all's peers wait in it)
            else:
                y = self.quant_method.apply(self, rows.x, rows.topk_weights, rows.slots, None)  # [N, H]
            return self.dispatch.combine(y, rows)  # [T, H], this rank's partial sum, or the whole (complete)
        return self.quant_method.apply(self, x, topk_weights, topk_ids, blocks)

    def run_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, blocks: MoeBlocks | None = None) -> torch.Tensor:  # fmt: skip
        """The experts on plain weights, by the backend fused_moe.py picks for this batch."""
        backend = choose_backend(self.backend, x, self.batch_invariant)
        if backend == "triton":
            return triton_experts(x, w13, w2, topk_weights, topk_ids, blocks=blocks,
                                  batch_invariant=self.batch_invariant)
        if backend == "grouped_mm":
            return grouped_mm_experts(x, w13, w2, topk_weights, topk_ids)
        return loop_experts(x, w13, w2, topk_weights, topk_ids, self.batch_invariant)


def _routing_sink() -> tuple[RoutingCaptureSink | None, torch.Tensor | None]:
    """The forward context's routing capture and the step's slot_mapping [T] (< 0: a padded token)."""
    try:
        ctx = get_forward_context()
    except RuntimeError:
        return None, None
    meta = ctx.attn_metadata
    return ctx.routing_capture, None if meta is None else meta.slot_mapping


def _replayed_ids(moe_index: int, num_tokens: int) -> torch.Tensor | None:
    try:
        ctx = get_forward_context()
    except RuntimeError:
        return None
    if ctx.routing_replay is None:
        return None
    return ctx.routing_replay.ids_for(moe_index, num_tokens)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ GLM's shared experts). Parameters mirror HF names under `mlp.`.

    router "softmax": Qwen3-MoE / Mixtral.  router "sigmoid_grouped": GLM-4.5.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        moe_index: int,
        router: str = "softmax",
        renormalize: bool = True,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        shared_intermediate_size: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        placement: ExpertPlacement | None = None,
    ) -> None:
        super().__init__()
        if router not in ("softmax", "sigmoid_grouped"):
            raise ValueError(f"unknown router {router!r}")
        if router == "sigmoid_grouped" and num_experts % n_group:
            raise ValueError(f"n_routed_experts={num_experts} is not divisible by n_group={n_group}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.moe_index = moe_index
        self.router = router
        self.renormalize = renormalize
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.batch_invariant = False  # the float32 router GEMM in fixed row tiles (model_executor/batch_invariant.py)
        self.expert_load = None  # (ExpertLoadRecorder, this layer's [E] counts), layers/expert_load.py
        self.use_fused_routing = fused_routing_enabled()  # route_fused() wherever Triton runs
        self.router_spec = (
            RouterSpec(top_k, "softmax", renormalize)
            if router == "softmax"
            else RouterSpec(top_k, "sigmoid", renormalize, n_group, topk_group, routed_scaling_factor)
        )
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # router weight [E, H]
        if router == "sigmoid_grouped":
            # selection-only bias (the model keeps this router float32, see MoeCausalLM._build)
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        # expert parallel (over the TP ranks): each rank holds whole experts, so they are not split on I
        ep_size = 1 if placement is None else placement.ep_size
        if ep_size > 1 and tp_size > 1 and ep_size != tp_size:
            raise ExpertPlacementError(f"the placement spreads experts over {ep_size} ranks, tensor parallelism over "
                                       f"{tp_size}: expert parallelism runs over the tensor-parallel ranks")
        expert_tp = (0, 1) if ep_size > 1 else (tp_rank, tp_size)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size, *expert_tp, placement)
        self.shared_experts = (
            # partial sums: forward() reduces routed + shared in one all-reduce
            GatedMLP(hidden_size, shared_intermediate_size, tp_rank, tp_size, reduce_results=False)
            if shared_intermediate_size
            else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_weights [T, K] float32, topk_ids [T, K] int64)."""
        if self.router == "softmax":
            router_logits = self.gate(x)  # [T, E]
            return softmax_topk(router_logits, self.top_k, self.renormalize)
        # [T, E], float32 like the reference
        router_logits = linear(x.float(), self.gate.weight.float(), batch_invariant=self.batch_invariant)
        return grouped_sigmoid_topk(
            router_logits,
            self.top_k,
            self.gate.e_score_correction_bias,
            self.n_group,
            self.topk_group,
            self.renormalize,
            self.routed_scaling_factor,
            self.batch_invariant,
        )

    def route_fused(self, x: torch.Tensor, sink: RoutingCaptureSink | None, slot_mapping: torch.Tensor | None,
                    block_m: int | None, router_logits: torch.Tensor | None = None) -> RoutingResult:  # fmt: skip
        """route() in one kernel launch (ops/fused_routing.py) that also writes the R3 capture row of every
        real token into the sink's step buffer and aligns the ids for the Triton experts (block_m).
        router_logits: the softmax router's gate of x, already computed (forward_normed)."""
        # a StepBufferSink (forward_context.py; worker/routing_capture.py) lends its step buffer. getattr, not
        # a runtime-checkable protocol: isinstance against one costs ~20 us a layer on the host
        lend = getattr(sink, "capture_buffer", None)  # StepBufferSink.capture_buffer
        buffer = None if lend is None else lend(self.moe_index, x.shape[0])  # [max_tokens, L, K]
        if slot_mapping is not None and slot_mapping.shape != (x.shape[0],):
            slot_mapping = None  # not this forward's tokens (a caller's own batch): write every row
        if self.router == "softmax":
            if router_logits is None:
                router_logits = router_gate(x, self.gate, self.batch_invariant)  # [T, E]: self.gate(x) or a GEMV
            bias = None
        else:
            # [T, E], float32 like route()
            router_logits = linear(x.float(), self.gate.weight.float(), batch_invariant=self.batch_invariant)
            bias = self.gate.e_score_correction_bias
        routed = fused_routing(router_logits, self.router_spec, bias, buffer, self.moe_index, slot_mapping, block_m,
                               batch_invariant=self.batch_invariant)  # fmt: skip
        if sink is not None and buffer is None:
            sink.capture(self.moe_index, routed.topk_ids)  # a sink without a step buffer takes the ids
        return routed

    def replay_weights(self, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], forced topk_ids [T, K] -> their router weights [T, K] float32, as route() would
        weigh them had it chosen them (same normalisation and scaling)."""
        if self.router == "softmax":
            probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
            weights = probs.gather(1, topk_ids)  # [T, K]
            return weights / weights.sum(dim=-1, keepdim=True) if self.renormalize else weights
        logits = linear(x.float(), self.gate.weight.float(), batch_invariant=self.batch_invariant)  # [T, E]
        scores = invariant_rows(torch.sigmoid, logits, self.batch_invariant)  # [T, E]
        weights = scores.gather(1, topk_ids)  # [T, K]
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor

    def forward_normed(self, x: torch.Tensor, norm: nn.Module,
                       residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(forward(norm(x + residual)), x + residual): the decoder layer's post-attention RMSNorm before this
        block. 1 to FUSED_GATE_NORM_MAX_ROWS softmax-routed rows on CUDA (a batch-1 decode or verify step)
        compute it inside the router gate's GEMV, which writes the normed rows for the experts (ops/gemv.py
        normed_gemv): one launch less."""
        weight = self.gate.weight
        if (FUSED_GATE_NORM and self.router == "softmax" and self.use_fused_routing
                and use_one_row_gemv(x, self.batch_invariant, FUSED_GATE_NORM_MAX_ROWS)
                and weight.dtype == x.dtype == norm.weight.dtype
                and getattr(self.gate, "bias", None) is None):  # fmt: skip
            logits, h, total = normed_gemv(x, residual, norm.weight, norm.eps, weight)  # [T, E], [T, H], [T, H]
            return self.forward(h, logits), total
        h, total = norm(x, residual)
        return self.forward(h), total

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. router_logits: the gate of x, computed with it (forward_normed)."""
        forced = _replayed_ids(self.moe_index, x.shape[0])  # [T, K] or None
        sink, slot_mapping = _routing_sink()
        blocks = None
        # R3 INVARIANT: the router runs on every rank over LOGICAL expert ids, and the capture below records
        # them right after the top-k, before the experts map them to ranks and slots (expert_placement.py,
        # expert_dispatch.py): a rank, slot or replica number never reaches a routing row
        if forced is None and self.use_fused_routing and use_triton(x):
            routed = self.route_fused(x, sink, slot_mapping, self.experts.triton_block_m(x, self.top_k), router_logits)
            topk_weights, topk_ids, blocks = routed.topk_weights, routed.topk_ids, routed.blocks  # [T, K], [T, K]
        else:
            if forced is None:
                topk_weights, topk_ids = self.route(x)  # [T, K], [T, K]
            else:
                topk_ids = forced.to(device=x.device, dtype=torch.int64)  # [T, K]
                topk_weights = self.replay_weights(x, topk_ids)  # [T, K]
            if sink is not None:
                sink.capture(self.moe_index, topk_ids)
        if self.expert_load is not None:  # the same logical ids the capture took, counted on the device
            self.expert_load[0].count(self.expert_load[1], topk_ids, slot_mapping)
        out = self.experts(x, topk_weights, topk_ids, blocks)  # [T, H], this rank's partial sum
        if self.experts.dispatch is not None and self.experts.dispatch.complete:
            # an all-to-all dispatch gave every token's whole routed output: only the shared experts' sum is left
            return out if self.shared_experts is None else out + all_reduce(self.shared_experts(x))  # [T, H]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)  # [T, H]
        return all_reduce(out)  # [T, H]
