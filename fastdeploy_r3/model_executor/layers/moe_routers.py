"""The routers of the MoE block on the CPU (and the reference the fused routing kernel, ops/fused_routing.py,
is held to): softmax top-k (Qwen3-MoE, Mixtral) and grouped sigmoid top-k (GLM-4.5), with one tie rule."""

from __future__ import annotations

import torch

from fastdeploy_r3.model_executor.batch_invariant import invariant_rows


def topk_lower_id_first(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk over the last dim with a stated tie rule: equal scores rank the lower expert id first.

    torch.topk's own order among ties depends on the device and the input size (on the CPU, 4 equal
    scores out of 128 come back as 60, 7, 100, 5), and an R3 row must not: the fused routing kernel
    (ops/fused_routing.py) follows this rule too. A stable descending sort is that rule.
    """
    values, ids = torch.sort(scores, dim=-1, descending=True, stable=True)  # [..., E], [..., E]
    return values[..., :k], ids[..., :k]


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE / Mixtral routing: softmax over all experts, keep the top k.

    Mixtral always renormalises (== softmax over the top-k logits); Qwen3 does so when norm_topk_prob.
    Returns (topk_weights [T, K] float32, topk_ids [T, K] int64).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    topk_weights, topk_ids = topk_lower_id_first(probs, top_k)  # [T, K], [T, K]
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
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-4.5 / DeepSeek-V3 routing (noaux_tc).

    The correction bias only steers WHICH experts are chosen (load balancing); the weights come from
    the un-biased sigmoid scores. Experts are chosen within the topk_group groups whose two best
    biased scores sum highest.
    """
    num_tokens, num_experts = router_logits.shape
    scores = invariant_rows(torch.sigmoid, router_logits.float(), batch_invariant)  # [T, E]
    biased = scores + e_score_correction_bias.float()  # [T, E]
    per_group = biased.view(num_tokens, n_group, num_experts // n_group)  # [T, G, E/G]
    group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1)[0].sum(dim=-1)  # [T, G]
    group_ids = topk_lower_id_first(group_scores, topk_group)[1]  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1.0)  # [T, G]
    expert_mask = group_mask[:, :, None].expand_as(per_group).reshape(num_tokens, num_experts)  # [T, E]
    biased = biased.masked_fill(expert_mask == 0, float("-inf"))  # [T, E]
    # sorted (HF's reference uses sorted=False): the unsorted order is the device's choice, and R3 rows of
    # the same routing must not depend on whether the step ran on the CPU or a GPU
    topk_ids = topk_lower_id_first(biased, top_k)[1]  # [T, K], by biased score, best first
    topk_weights = scores.gather(1, topk_ids)  # [T, K]
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids
