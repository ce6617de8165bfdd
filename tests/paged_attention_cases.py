"""Random paged-attention batches for the kernel tests (CPU under the Triton interpreter, and on the GPU).

A case is a list of rows (cached context tokens, new query tokens): (0, 9) is a fresh prefill, (12, 5)
a prefix hit or a later chunk, (30, 1) a decode token, (0, 0) a row with nothing this step. Padded rows
(seq_len 0, one token, slot -1) are appended as a CUDA graph pads a decode batch.

Blocks are handed out in a shuffled order from a pool larger than needed, so block tables are
scattered and unused blocks hold garbage that a wrong index would read ("holes"); block-table entries
past a row's last block are filled with a block that belongs to another row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdeploy_r3.model_executor.forward_context import AttentionMetadata
from fastdeploy_r3.model_executor.layers.attention import TorchPagedAttentionBackend, TritonPagedAttentionBackend


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, KVH, D]
    v: torch.Tensor  # [T, KVH, D]
    k_cache: torch.Tensor  # [NB, BS, KVH, D], prefix positions already filled
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float
    real_tokens: int  # tokens before the padded rows


def make_case(
    rows: list[tuple[int, int]],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    padded_rows: int = 0,
    seed: int = 0,
) -> PagedCase:
    g = torch.Generator().manual_seed(seed)
    max_blocks = max((-(-(c + n) // block_size) for c, n in rows), default=1) or 1
    num_blocks = sum(-(-(c + n) // block_size) for c, n in rows) + 5
    order = torch.randperm(num_blocks, generator=g).tolist()
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=g).to(dtype)  # garbage everywhere: holes read as noise
    v_cache = torch.randn(cache_shape, generator=g).to(dtype)
    tables = torch.full((len(rows) + padded_rows, max_blocks), order[-1], dtype=torch.int64)
    slots, starts, qlens, slens = [], [0], [], []
    for b, (ctx, new) in enumerate(rows):
        n_used = -(-(ctx + new) // block_size)
        tables[b, :n_used] = torch.tensor(order[:n_used], dtype=torch.int64)
        order = order[n_used:]
        pos = torch.arange(ctx, ctx + new)
        slots.append(tables[b, pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + new)
        qlens.append(new)
        slens.append(ctx + new)
    real = starts[-1]
    for _ in range(padded_rows):
        slots.append(torch.tensor([-1]))
        starts.append(starts[-1] + 1)
        qlens.append(1)
        slens.append(0)
    num_tokens = starts[-1]
    scale = head_dim**-0.5
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    dev = torch.device(device)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(dev) if slots else torch.zeros(0, dtype=torch.int64, device=dev),
        query_start_loc=starts, query_lens=qlens, seq_lens=slens, block_tables=tables.to(dev), block_size=block_size,
    )  # fmt: skip
    return PagedCase(q.to(dev), k.to(dev), v.to(dev), k_cache.to(dev), v_cache.to(dev), meta, scale, real)


def run_torch(case: PagedCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [T, H, D], k_cache, v_cache) of the oracle backend, on copies of the case's caches."""
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out = TorchPagedAttentionBackend().forward(case.q, case.k, case.v, (k_cache, v_cache), case.meta, case.scale)
    return out, k_cache, v_cache


def run_triton(case: PagedCase, **kernel_kw: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same as run_torch through TritonPagedAttentionBackend (kernel_kw: e.g. num_splits for decode, or the
    max_seq_len a CUDA graph would pass: the longest context it may see)."""
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    if not kernel_kw:
        out = TritonPagedAttentionBackend().forward(case.q, case.k, case.v, (k_cache, v_cache), case.meta, case.scale)
        return out, k_cache, v_cache
    from fastdeploy_r3.model_executor.ops.kv_cache_write import write_kv_cache
    from fastdeploy_r3.model_executor.ops.paged_decode import paged_decode_attention

    meta = case.meta
    write_kv_cache(case.k, case.v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(case.q)
    paged_decode_attention(
        case.q, k_cache, v_cache, meta.block_tables, meta.seq_lens_tensor, meta.query_start_loc_tensor, case.scale,
        out, max_seq_len=kernel_kw.pop("max_seq_len", meta.max_seq_len), **kernel_kw,
    )  # fmt: skip
    return out, k_cache, v_cache
