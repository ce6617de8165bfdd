"""Expert load: how many (token, k) rows each MoE layer routed to each LOGICAL expert (SGLang's expert
distribution record: /start_expert_distribution_record, /stop_..., /dump_...).

    counts [L, E] int64 on the device     += bincount of the step's real tokens' topk_ids, per layer
    recording [1] int64 on the device     1 between start and stop, else 0: the rows count times it

Each MoE layer adds its step's rows into its row of `counts` with one index_add_ (no host sync, so a
step costs no round trip) while a record runs, and not at all otherwise: steps that are not recorded run
no counting kernel (48 index_add_ a decode step of Qwen3-30B-A3B: 0.13 of its 4.45 ms of GPU time at
batch 1 on the H200). CUDA graphs bake in whether they count, so the worker re-captures its decode
graphs when a record starts or stops (worker/weight_loading.py expert_distribution); the device flag
also multiplies the rows, so a graph that counted adds nothing once the record stopped.

Padded tokens (slot_mapping < 0: a CUDA graph's batch padding) are not counted, so the counts are
exactly the rows the R3 capture records for the same forward passes. The counts are LOGICAL ids (the
router's, the same ids R3 records), taken before the dispatch maps them to ranks and replicas: what
a rebalance (EPLB) needs, independent of the current placement.

Under expert parallelism every rank routes every token (attention is tensor-parallel, the router
replicated), so every rank counts the same rows: rank 0's counts are the model's (the engine checks
that the ranks agree rather than summing N copies).
"""

from __future__ import annotations

import torch
from torch import nn


class ExpertLoadRecorder:
    """The per-layer counters of one model's MoE blocks (not its draft layer's)."""

    def __init__(self, model: nn.Module) -> None:
        from fastdeploy_r3.model_executor.layers.moe import SparseMoeBlock

        draft = getattr(model, "draft_layer", None)
        in_draft = {id(m) for m in draft.modules()} if isinstance(draft, nn.Module) else set()
        blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock) and id(m) not in in_draft]
        if not blocks:
            raise ValueError(f"{type(model).__name__} has no MoE layer whose expert load could be recorded")
        self.num_layers = max(b.moe_index for b in blocks) + 1
        self.num_experts = blocks[0].num_experts
        device = blocks[0].gate.weight.device
        self.counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64, device=device)  # [L, E]
        self.flag = torch.zeros(1, dtype=torch.int64, device=device)  # [1] 1 while recording
        self.recording = False
        for b in blocks:
            b.expert_load = (self, self.counts[b.moe_index])  # [E] view: this layer's row

    def start(self) -> None:
        """Forget earlier counts and count from the next step on (SGLang: start resets the record)."""
        self.counts.zero_()
        self.flag.fill_(1)
        self.recording = True

    def stop(self) -> None:
        """Stop counting; the counts so far stay for dump()."""
        self.flag.fill_(0)
        self.recording = False

    def dump(self) -> list[list[int]]:
        """[L][E] rows routed to each logical expert of each MoE layer since start() (one host sync)."""
        return self.counts.cpu().tolist()

    def count(self, layer_counts: torch.Tensor, topk_ids: torch.Tensor, slot_mapping: torch.Tensor | None) -> None:
        """Add one layer's step: topk_ids [T, K] logical; slot_mapping [T] (< 0: a padded token) or None."""
        if not self.recording:  # a graph captured now never counts: re-captured when a record starts
            return
        rows = torch.ones_like(topk_ids) if slot_mapping is None or slot_mapping.shape[0] != topk_ids.shape[0] \
            else (slot_mapping >= 0).to(torch.int64).unsqueeze(1).expand_as(topk_ids)  # [T, K]
        layer_counts.index_add_(0, topk_ids.reshape(-1).to(torch.int64), (rows * self.flag).reshape(-1))
