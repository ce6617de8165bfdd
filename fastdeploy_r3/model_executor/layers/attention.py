"""Paged attention: one small module, one swappable backend.

KV cache layout, per layer (shared by every backend):

    k_cache, v_cache: [num_blocks, block_size, KVH, D]
    slot = block_id * block_size + offset      (AttentionMetadata.slot_mapping, one slot per new token)

    request b:  block_tables[b] = [7, 2, 5]  with block_size 4, seq_lens[b] = 10
                positions 0..3 -> block 7, 4..7 -> block 2, 8..9 -> block 5 (slots 20, 21)

A step's tokens are first written into their slots; then each request attends over positions
[0, seq_lens[b]) read back through its block table, so a chunked prefill or a prefix-cache hit is
the same code path as decode.

Backends: TorchPagedAttentionBackend (a loop over requests; the CPU path and the oracle) and
TritonPagedAttentionBackend (ops/: one kv-write launch, then one decode launch for the whole batch,
its splits combined by the last to finish, or one prefill launch for ragged batches; no host sync,
CUDA-graph safe). With the Triton backend the rotary kernel writes the step's k/v into the cache in
its own launch (Attention.kv_write_target) and the backend skips its write launch.
An Attention module without an explicit backend picks Triton for CUDA tensors, torch otherwise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from fastdeploy_r3.model_executor.forward_context import AttentionMetadata, get_forward_context
from fastdeploy_r3.model_executor.ops.kv_cache_write import write_kv_cache, write_kv_cache_ref
from fastdeploy_r3.model_executor.ops.paged_decode import (
    paged_decode_attention,
    short_query_rows,
    use_short_query_decode,
)
from fastdeploy_r3.model_executor.ops.paged_prefill import paged_prefill_attention
from fastdeploy_r3.model_executor.ops.rotary import KvTarget
from fastdeploy_r3.model_executor.ops.triton_setup import use_triton


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
        return paged_attention_loop(q, k, v, kv_cache, attn_metadata, scale,
                                    lambda q_b, k_ctx, v_ctx, sc: _causal_attention(q_b, k_ctx.to(q.dtype),
                                                                                    v_ctx.to(q.dtype), sc))


def paged_attention_loop(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    kv_cache: tuple[torch.Tensor, torch.Tensor],  # [NB, BS, KVH, D] each
    attn_metadata: AttentionMetadata,
    scale: float,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor],
) -> torch.Tensor:  # [T, H, D]
    """Write the step's k/v into the paged cache, then per request gather its context through its block
    table and attend(q [Q, H, D], k [S, KVH, D], v [S, KVH, D], scale) -> [Q, H, D]: the torch backends'
    shared loop (this reference and model_executor/batch_invariant.py's)."""
    k_cache, v_cache = kv_cache
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    write_kv_cache_ref(k, v, k_cache, v_cache, attn_metadata.slot_mapping)

    out = torch.empty_like(q)  # [T, H, D]
    for b, query_len in enumerate(attn_metadata.query_lens):
        if query_len == 0:
            continue
        start = attn_metadata.query_start_loc[b]
        seq_len = attn_metadata.seq_lens[b]
        if seq_len == 0:  # a padded row, as the Triton backend treats it
            out[start : start + query_len] = 0
            continue
        num_used = -(-seq_len // block_size)
        block_ids = attn_metadata.block_tables[b, :num_used].to(k_cache.device)  # [nb]
        k_ctx = k_cache[block_ids].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [S, KVH, D]
        v_ctx = v_cache[block_ids].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [S, KVH, D]
        out[start : start + query_len] = attend(q[start : start + query_len], k_ctx, v_ctx, scale)
    return out


class TritonPagedAttentionBackend(AttentionBackend):
    """Triton kernels over the device-side metadata; graph-safe when the metadata has a fixed capacity.

    Every token must belong to a row (query_start_loc[B] == T); max_query_len == 1 takes the decode
    kernel (split-KV sized by max_seq_len); a few query tokens a row at a small batch (a speculative
    verify step) take it too, one row per token (ops/paged_decode.py short_query_rows), where the
    prefill kernel would run one program per (row, kv head) over the whole context; anything else the
    ragged prefill kernel.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
        scale: float,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """kv_written: the step's k/v are in the cache already (the rotary kernel wrote them)."""
        k_cache, v_cache = kv_cache
        meta = attn_metadata
        assert meta.seq_lens_tensor is not None and meta.query_start_loc_tensor is not None  # __post_init__
        assert meta.max_query_len is not None and meta.max_seq_len is not None
        if not kv_written:
            write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        q = q if q.stride(2) == 1 else q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
        args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens_tensor, meta.query_start_loc_tensor, scale, out)
        if meta.max_query_len == 1:
            return paged_decode_attention(*args, max_seq_len=meta.max_seq_len)
        if use_short_query_decode(meta.seq_lens_tensor.shape[0], k_cache.shape[2], meta.max_query_len, q.device):
            rows = meta.derived.get("short_query_rows")  # one expansion per step, not per layer
            if rows is None:
                rows = meta.derived["short_query_rows"] = short_query_rows(
                    meta.block_tables, meta.seq_lens_tensor, meta.query_start_loc_tensor, q.shape[0])
            return paged_decode_attention(q, k_cache, v_cache, *rows, scale, out, max_seq_len=meta.max_seq_len)
        return paged_prefill_attention(*args, max_query_len=meta.max_query_len)


_default_backend: AttentionBackend | None = None


def set_default_attention_backend(backend: AttentionBackend | None) -> None:
    """Backend used by Attention modules built afterwards; None: chosen per call by the tensors' device."""
    global _default_backend
    _default_backend = backend


_TORCH_BACKEND = TorchPagedAttentionBackend()
_TRITON_BACKEND = TritonPagedAttentionBackend()


def _backend_for(x: torch.Tensor) -> AttentionBackend:
    """The backend an Attention without an explicit one uses for tensors on x's device."""
    return _TRITON_BACKEND if use_triton(x) else _TORCH_BACKEND


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

    def kv_write_target(self, v: torch.Tensor) -> KvTarget | None:
        """(v, k_cache, v_cache, slot_mapping) when this forward's backend is the Triton one: the rotary
        kernel may then write the step's k/v into the cache (ops/rotary.py) and forward(kv_written=True)
        skips the write launch. None otherwise (no cache, the torch or deterministic backends)."""
        ctx = get_forward_context()
        if ctx.attn_metadata is None or (self.backend or _backend_for(v)) is not _TRITON_BACKEND:
            return None
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        return v, k_cache, v_cache, ctx.attn_metadata.slot_mapping

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_written: bool = False) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H * D]. kv_written: the target kv_write_target gave was
        written (by the rotary kernel) and the backend only reads the cache."""
        ctx = get_forward_context()
        if ctx.attn_metadata is None:
            # no cache: the T tokens are one sequence starting at position 0 (tests, HF comparisons)
            out = _causal_attention(q, k, v, self.scale)
        elif kv_written:  # only offered for the Triton backend (kv_write_target)
            out = _TRITON_BACKEND.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.attn_metadata, self.scale,
                                          kv_written=True)  # fmt: skip
        else:
            backend = self.backend or _backend_for(q)
            out = backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.attn_metadata, self.scale)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
