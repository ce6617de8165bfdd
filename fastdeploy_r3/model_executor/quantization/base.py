"""The hook a quantization method plugs into: a layer asks its method to create, prepare and apply weights.

    layer.__init__             method.create_weights(layer, ...)       parameters in the checkpoint's format
    load_model, after loading  method.process_weights_after_loading(layer)   e.g. repack, transpose scales
    layer.forward              method.apply(layer, x, ...)              the GEMM(s) for that format

An unquantized layer holds `weight` (and `bias`) in the model dtype and applies F.linear; an FP8 method
will hold fp8 `weight` plus `weight_scale_inv` and apply a scaled GEMM, with the layer's code unchanged.
"""

from __future__ import annotations

import abc
from typing import Any

import torch
from torch import nn

from fastdeploy_r3.model_executor.ops.moe_align import MoeBlocks


class QuantizationMethod(abc.ABC):
    """How one kind of layer holds and uses its weights under one quantization scheme (the layer kinds
    below fix the arguments)."""

    @abc.abstractmethod
    def create_weights(self, layer: nn.Module, *sizes: Any) -> None:
        """Register the layer's parameters, in this scheme's format, on `layer`."""

    @abc.abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, *args: Any) -> torch.Tensor:
        """The layer's forward on its parameters."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Called once every weight of the model is loaded; nothing to do for weights used as loaded."""


class LinearMethod(QuantizationMethod):
    """For a linear layer y = x W^T (+ b) with W [out_features, in_features] as this rank holds it."""

    @abc.abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        """Register the layer's parameters (`weight`, and `bias` or None)."""

    @abc.abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features]."""

    def apply_normed(self, layer: nn.Module, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None,
                     bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The RMSNorm `norm` (layers/norm.py) before this linear, which a method may fuse into its GEMM:
        (norm(s) W^T (+ b), s) with s = x + residual (x itself when residual is None). Here: the norm, then
        apply."""
        if residual is None:
            return self.apply(layer, norm(x), bias), x
        h, total = norm(x, residual)
        return self.apply(layer, h, bias), total


class MoEMethod(QuantizationMethod):
    """For stacked SwiGLU experts: w13 [E, 2I, H] (gate; up) and w2 [E, H, I] as this rank holds them."""

    @abc.abstractmethod
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        """Register the experts' parameters (`w13`, `w2`)."""

    @abc.abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        blocks: MoeBlocks | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """x [T, H], topk_weights [T, K], topk_ids [T, K] -> [T, H] (this rank's partial sum under TP).

        blocks: topk_ids already aligned for the Triton experts (ops/moe_align.py); a method may ignore it."""

    def uses_alignment(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether apply() on x takes the Triton experts' aligned blocks, so that the routing kernel should
        align the ids for it (a method that serves some batches another way says no for those)."""
        return True
