"""MoE block: router variants (the same on every device) + routed experts (loop on the CPU, fused on CUDA).

Shape legend: T = tokens, H = hidden size, E = routed experts, K = experts per token,
I = expert intermediate size, G = expert groups.

Right after top-k the layer reports its LOGICAL expert ids [T, K] to the forward context's routing
capture (R3); nothing after that point may change which experts a token uses.

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
from fastdeploy_r3.model_executor.forward_context import get_forward_context
from fastdeploy_r3.model_executor.layers.fused_moe import choose_backend, grouped_mm_experts
from fastdeploy_r3.model_executor.layers.linear import divide
from fastdeploy_r3.model_executor.layers.mlp import GatedMLP
from fastdeploy_r3.model_executor.ops.fused_moe_triton import triton_experts


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE / Mixtral routing: softmax over all experts, keep the top k.

    Mixtral always renormalises (== softmax over the top-k logits); Qwen3 does so when norm_topk_prob.
    Returns (topk_weights [T, K] float32, topk_ids [T, K] int64).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [T, K], [T, K]
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def grouped_sigmoid_topk(
    router_logits: torch.Tensor,
    top_k: int,
    e_score_correction_bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-4.5 / DeepSeek-V3 routing (noaux_tc).

    The correction bias only steers WHICH experts are chosen (load balancing); the weights come from
    the un-biased sigmoid scores. Experts are chosen within the topk_group groups whose two best
    biased scores sum highest.
    """
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.float().sigmoid()  # [T, E]
    biased = scores + e_score_correction_bias.float()  # [T, E]
    per_group = biased.view(num_tokens, n_group, num_experts // n_group)  # [T, G, E/G]
    group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1)[0].sum(dim=-1)  # [T, G]
    group_ids = group_scores.topk(topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1.0)  # [T, G]
    expert_mask = group_mask[:, :, None].expand_as(per_group).reshape(num_tokens, num_experts)  # [T, E]
    biased = biased.masked_fill(expert_mask == 0, float("-inf"))  # [T, E]
    # sorted (HF's reference uses sorted=False): the unsorted order is the device's choice, and R3 rows of
    # the same routing must not depend on whether the step ran on the CPU or a GPU
    topk_ids = biased.topk(top_k, dim=-1, sorted=True)[1]  # [T, K], by biased score, best first
    topk_weights = scores.gather(1, topk_ids)  # [T, K]
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids


def loop_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The reference: a Python loop over the experts that received tokens (host syncs: CPU path only).

    x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K], topk_ids [T, K] -> [T, H]. Memory stays
    O(T * H), unlike gathering [T, K, 2I, H].
    """
    out = torch.zeros_like(x)  # [T, H]
    for e in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == e)  # [n], [n]
        gate, up = F.linear(x[token_idx], w13[e]).chunk(2, dim=-1)  # [n, I], [n, I]
        y = F.linear(F.silu(gate) * up, w2[e])  # [n, H]
        y = y * topk_weights[token_idx, slot, None].to(y.dtype)  # [n, H]
        out.index_add_(0, token_idx, y)
    return out


class StackedExperts(nn.Module):
    """E SwiGLU experts stored stacked (the layout the fused kernels read): w13 = [gate; up].

    `backend` ("auto" by default; see fused_moe.BACKENDS) says how forward() computes them.

    With N ranks, I below is this rank's I/N: w13[e] = [gate[r-th I/N rows]; up[r-th I/N rows]] and
    w2[e] = down[:, r-th I/N columns]; forward() then returns this rank's partial sum.
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.tp_rank = tp_rank
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = divide(intermediate_size, tp_size, "expert intermediate size")
        inter = self.intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))  # [E, 2I, H]
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter))  # [E, H, I]
        self.backend = "auto"

    def load_expert(self, expert: int, proj: str, full: torch.Tensor) -> None:
        """Copy this rank's slice of one checkpoint tensor: proj "gate"/"up" [I_full, H], "down" [H, I_full]."""
        inter = self.intermediate_size
        start = self.tp_rank * inter
        if proj == "gate":
            self.w13[expert, :inter].copy_(full[start : start + inter])
        elif proj == "up":
            self.w13[expert, inter:].copy_(full[start : start + inter])
        else:
            assert proj == "down", proj
            self.w2[expert].copy_(full[:, start : start + inter])

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_weights [T, K], topk_ids [T, K] -> [T, H] (fused_moe.py picks how)."""
        backend = choose_backend(self.backend, x)
        if backend == "triton":
            return triton_experts(x, self.w13, self.w2, topk_weights, topk_ids)
        if backend == "grouped_mm":
            return grouped_mm_experts(x, self.w13, self.w2, topk_weights, topk_ids)
        return loop_experts(x, self.w13, self.w2, topk_weights, topk_ids)


def _capture_routing(moe_index: int, topk_ids: torch.Tensor) -> None:
    try:
        ctx = get_forward_context()
    except RuntimeError:
        return
    if ctx.routing_capture is not None:
        ctx.routing_capture.capture(moe_index, topk_ids)


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
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # router weight [E, H]
        if router == "sigmoid_grouped":
            # selection-only bias (the model keeps this router float32, see MoeCausalLM._build)
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size, tp_rank, tp_size)
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
        router_logits = F.linear(x.float(), self.gate.weight.float())  # [T, E], float32 like the reference
        return grouped_sigmoid_topk(
            router_logits,
            self.top_k,
            self.gate.e_score_correction_bias,
            self.n_group,
            self.topk_group,
            self.renormalize,
            self.routed_scaling_factor,
        )

    def replay_weights(self, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], forced topk_ids [T, K] -> their router weights [T, K] float32, as route() would
        weigh them had it chosen them (same normalisation and scaling)."""
        if self.router == "softmax":
            probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
            weights = probs.gather(1, topk_ids)  # [T, K]
            return weights / weights.sum(dim=-1, keepdim=True) if self.renormalize else weights
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()  # [T, E]
        weights = scores.gather(1, topk_ids)  # [T, K]
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        forced = _replayed_ids(self.moe_index, x.shape[0])  # [T, K] or None
        if forced is None:
            topk_weights, topk_ids = self.route(x)  # [T, K], [T, K]
        else:
            topk_ids = forced.to(device=x.device, dtype=torch.int64)  # [T, K]
            topk_weights = self.replay_weights(x, topk_ids)  # [T, K]
        _capture_routing(self.moe_index, topk_ids)
        out = self.experts(x, topk_weights, topk_ids)  # [T, H], this rank's partial sum
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)  # [T, H]
        return all_reduce(out)  # [T, H]
