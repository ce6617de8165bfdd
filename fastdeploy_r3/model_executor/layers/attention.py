"""Paged attention: one small module, one swappable backend.

KV cache layout, per layer (shared by every backend):

    k_cache, v_cache: [num_blocks, block_size, KVH, D]
    slot = block_id * block_size + offset      (AttentionMetadata.slot_mapping, one slot per new token)

    request b:  block_tables[b] = [7, 2, 5]  with block_size 4, seq_lens[b] = 10
                positions 0..3 -> block 7, 4..7 -> block 2, 8..9 -> block 5 (slots 20, 21)

A step's tokens are first written into their slots; then each request attends over positions
[0, seq_lens[b]) read back through its block table, so a chunked prefill or a prefix-cache hit is
the same code path as decode.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from fastdeploy_r3.model_executor.forward_context import AttentionMetadata, get_forward_context


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Q, H, D] are the LAST Q positions of a context k, v [S, KVH, D] -> [Q, H, D]."""
    num_q, num_heads, _ = q.shape
    num_ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    # GQA: query head h reads kv head h // group
    k = k.repeat_interleave(group, dim=1)  # [S, H, D]
    v = v.repeat_interleave(group, dim=1)  # [S, H, D]
    scores = torch.einsum("qhd,shd->hqs", q, k) * scale  # [H, Q, S]
    q_pos = torch.arange(num_ctx - num_q, num_ctx, device=q.device)  # [Q]
    k_pos = torch.arange(num_ctx, device=q.device)  # [S]
    mask = k_pos[None, :] > q_pos[:, None]  # [Q, S] True where the key is in the future
    scores = scores.masked_fill(mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [H, Q, S]
    return torch.einsum("hqs,shd->qhd", probs, v)  # [Q, H, D]


class AttentionBackend(ABC):
    """Computes attention for a step; writes the step's k/v into the layer's paged cache first."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # [NB, BS, KVH, D] each
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        ...


class TorchPagedAttentionBackend(AttentionBackend):
    """Reference backend: a Python loop over requests; the oracle for faster backends."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        slots = attn_metadata.slot_mapping.to(k_cache.device)  # [T]
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k.to(k_cache.dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v.to(v_cache.dtype)

        out = torch.empty_like(q)  # [T, H, D]
        for b, query_len in enumerate(attn_metadata.query_lens):
            if query_len == 0:
                continue
            start = attn_metadata.query_start_loc[b]
            seq_len = attn_metadata.seq_lens[b]
            num_used = -(-seq_len // block_size)
            block_ids = attn_metadata.block_tables[b, :num_used].to(k_cache.device)  # [nb]
            k_ctx = k_cache[block_ids].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [S, KVH, D]
            v_ctx = v_cache[block_ids].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [S, KVH, D]
            q_b = q[start : start + query_len]  # [Q, H, D]
            out[start : start + query_len] = _causal_attention(q_b, k_ctx.to(q.dtype), v_ctx.to(q.dtype), scale)
        return out


_default_backend: AttentionBackend = TorchPagedAttentionBackend()


def set_default_attention_backend(backend: AttentionBackend) -> None:
    """Backend used by Attention modules built afterwards (e.g. a Triton backend on CUDA)."""
    global _default_backend
    _default_backend = backend


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.backend = _default_backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H * D]."""
        ctx = get_forward_context()
        if ctx.attn_metadata is None:
            # no cache: the T tokens are one sequence starting at position 0 (tests, HF comparisons)
            out = _causal_attention(q, k, v, self.scale)
        else:
            out = self.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.attn_metadata, self.scale)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
