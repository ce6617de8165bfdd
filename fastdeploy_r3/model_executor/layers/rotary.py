"""Rotary position embedding (neox layout: rotate halves), with partial rotary for GLM.

Only the first `rotary_dim` channels of each head rotate; the rest pass through unchanged
(GLM-4.5 uses partial_rotary_factor=0.5).

cos/sin depend on the positions alone, so a model computes them once per forward (`cos_sin`) and every
layer applies them (`apply`, with Qwen3's per-head q/k norms before it): in place by one Triton kernel
on CUDA, by the torch references on the CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy_r3.model_executor.batch_invariant import invariant_rows
from fastdeploy_r3.model_executor.layers.norm import RMSNorm
from fastdeploy_r3.model_executor.ops.rotary import KvTarget, apply_rotary_, apply_rotary_ref
from fastdeploy_r3.model_executor.ops.triton_setup import use_triton

CosSin = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, R/2] float32


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, base: float) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and <= head_dim={head_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.base = base
        self.batch_invariant = False  # cos / sin in fixed row tiles on the CPU (model_executor/batch_invariant.py)

    def cos_sin(self, positions: torch.Tensor) -> CosSin:
        """positions [T] -> cos, sin [T, R/2] float32."""
        # recomputed per forward (R/2 numbers) rather than a buffer, so that model.to(bfloat16) cannot round it;
        # the formula is the HF reference's so that cos/sin agree bit for bit
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float, device=positions.device) / self.rotary_dim
        inv_freq = 1.0 / (self.base**exponent)  # [R/2]
        freqs = positions[:, None].float() * inv_freq[None, :]  # [T, R/2]
        invariant = self.batch_invariant
        return invariant_rows(torch.cos, freqs, invariant), invariant_rows(torch.sin, freqs, invariant)

    def apply(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin: CosSin,
        qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
        kv_target: KvTarget | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, KVH, D] -> rotated (q, k), after the per-head norms qk_norm = (q_norm, k_norm)
        if given. On CUDA one kernel does both and q and k are overwritten and returned.

        kv_target = (v, k_cache, v_cache, slot_mapping), only where the kernel runs (Attention.kv_write_target
        offers one only then): the same launch writes the rotated k and v into their cache slots."""
        cos, sin = cos_sin
        kernel = use_triton(q) and q.stride(-1) == 1 and k.stride(-1) == 1
        if kv_target is not None and not kernel:
            raise ValueError("RotaryEmbedding.apply: a fused KV cache write needs the Triton kernel and q / k "
                             "with a contiguous last dimension")
        if kernel:
            if qk_norm is not None and qk_norm[0].eps != qk_norm[1].eps:
                raise ValueError(f"q_norm eps {qk_norm[0].eps} and k_norm eps {qk_norm[1].eps} differ: give both one")
            norm = None if qk_norm is None else (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps)
            apply_rotary_(q, k, cos, sin, norm, kv_target)
            return q, k
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        return apply_rotary_ref(q, k, cos, sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, H, D]; k [T, KVH, D] -> rotated (q, k), same shapes and dtypes."""
        return self.apply(q, k, self.cos_sin(positions))
