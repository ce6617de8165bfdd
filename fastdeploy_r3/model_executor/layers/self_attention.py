"""A decoder layer's self-attention: the fused qkv projection (with the layer's input RMSNorm, which a
quantization method may fuse into its GEMM), the per-head q/k norms and rotary in one kernel that also
writes the paged KV cache, paged attention, and the o projection."""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy_r3.model_executor.layers.attention import Attention
from fastdeploy_r3.model_executor.layers.linear import RowParallelLinear, divide
from fastdeploy_r3.model_executor.layers.norm import RMSNorm
from fastdeploy_r3.model_executor.layers.qkv_linear import QKVParallelLinear
from fastdeploy_r3.model_executor.layers.rotary import CosSin, RotaryEmbedding


class SelfAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        layer_idx: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        rms_norm_eps: float = 1e-6,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        """num_heads / num_kv_heads are the model's; this rank keeps heads [r*NH/N, (r+1)*NH/N) and the
        kv heads they read, [r*KVH/N, (r+1)*KVH/N) (GQA groups never straddle ranks)."""
        super().__init__()
        self.num_heads = divide(num_heads, tp_size, "num_attention_heads")
        self.num_kv_heads = divide(num_kv_heads, tp_size, "num_key_value_heads")
        self.head_dim = head_dim
        tp = {"tp_rank": tp_rank, "tp_size": tp_size}
        self.qkv_proj = QKVParallelLinear(hidden_size, num_heads, num_kv_heads, head_dim, bias=qkv_bias, **tp)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=o_bias, **tp)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5, layer_idx)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, cos_sin: CosSin | None = None, norm: nn.Module | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """positions [T], x [T, H] -> ([T, H], residual). NH, KVH below are this rank's head counts.

        cos_sin: the rotary cos/sin of `positions`, when the model computed them once for all layers.
        norm: the decoder layer's input RMSNorm, applied to x + residual before the qkv projection, which may
        fuse it into its GEMM (LinearMethod.apply_normed); the returned residual is then x + residual (x
        when residual is None). Without norm, x is the projection's input and residual comes back as given.
        """
        num_tokens = x.shape[0]
        if norm is None:
            qkv = self.qkv_proj(x)
        else:
            qkv, residual = self.qkv_proj.forward_normed(x, norm, residual)
        q, k, v = qkv.split(self.qkv_proj.split_sizes, dim=-1)  # views of one [T, (NH + 2 KVH) * D]
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, NH, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        cos_sin = self.rotary.cos_sin(positions) if cos_sin is None else cos_sin
        target = self.attn.kv_write_target(v)  # on the Triton path the rotary kernel also writes the k/v cache
        q, k = self.rotary.apply(q, k, cos_sin, None if self.q_norm is None else (self.q_norm, self.k_norm), target)
        return self.o_proj(self.attn(q, k, v, kv_written=target is not None)), residual  # [T, H], all ranks
