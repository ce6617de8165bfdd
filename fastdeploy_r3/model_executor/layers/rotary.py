"""Rotary position embedding (neox layout: rotate halves), with partial rotary for GLM.

Only the first `rotary_dim` channels of each head rotate; the rest pass through unchanged
(GLM-4.5 uses partial_rotary_factor=0.5).
"""

from __future__ import annotations

import torch
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, base: float) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and <= head_dim={head_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.base = base

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, H, D]; k [T, KVH, D] -> rotated (q, k), same shapes and dtypes."""
        # recomputed per call (R/2 numbers) rather than a buffer, so that model.to(bfloat16) cannot round it;
        # the formula is the HF reference's so that cos/sin agree bit for bit
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float, device=positions.device) / self.rotary_dim
        inv_freq = 1.0 / (self.base**exponent)  # [R/2]
        freqs = positions[:, None].float() * inv_freq[None, :]  # [T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, R]
        cos = emb.cos().to(q.dtype)[:, None, :]  # [T, 1, R]
        sin = emb.sin().to(q.dtype)[:, None, :]  # [T, 1, R]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        if r == self.head_dim:
            return x * cos + _rotate_half(x) * sin
        x_rot, x_pass = x[..., :r], x[..., r:]  # [T, H, R], [T, H, D - R]
        return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)
