"""The method every layer runs today: weights in the model dtype, used exactly as loaded."""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy_r3.model_executor.batch_invariant import linear
from fastdeploy_r3.model_executor.ops.moe_align import MoeBlocks
from fastdeploy_r3.model_executor.quantization.base import LinearMethod, MoEMethod


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features))  # [O, I]
        layer.bias = nn.Parameter(torch.empty(out_features)) if bias else None  # [O]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias, batch_invariant=layer.batch_invariant)  # [T, O]


class UnquantizedMoEMethod(MoEMethod):
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        layer.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))  # [E, 2I, H]
        layer.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))  # [E, H, I]

    def apply(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        blocks: MoeBlocks | None = None,
    ) -> torch.Tensor:  # fmt: skip
        # the layer picks the kernel for plain weights (loop / grouped_mm / Triton: layers/fused_moe.py)
        return layer.run_experts(x, layer.w13, layer.w2, topk_weights, topk_ids, blocks)
