"""RMSNorm computed in float32 (as the HF reference does) and cast back to the input dtype, optionally
fused with the residual add before it (one Triton kernel on CUDA, the torch reference on the CPU)."""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy_r3.model_executor.ops.rms_norm import rms_norm, rms_norm_ref
from fastdeploy_r3.model_executor.ops.triton_setup import use_triton


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] -> normed; with residual: s = x + residual, returns (norm(s), s)."""
        # the variance in float32 keeps bf16 stable, the weight multiplies in the input dtype
        if use_triton(x) and x.dim() in (2, 3) and x.stride(-1) == 1:
            return rms_norm(x, self.weight, self.eps, residual)
        return rms_norm_ref(x, self.weight, self.eps, residual)
