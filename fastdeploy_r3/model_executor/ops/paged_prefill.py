"""Paged prefill attention for ragged batches: cached prefix + chunked prefill in one causal kernel.

Shape legend as in paged_decode.py; M = query tokens a program takes, N = context tokens per tile.

Row b brings query_lens[b] = query_start_loc[b + 1] - query_start_loc[b] new tokens, the LAST ones of a
context of seq_lens[b] tokens whose k/v (the new ones included) are already in the cache:

    context  [0 .......... seq_len - q_len) [seq_len - q_len ..... seq_len)
              cached prefix / earlier chunks   this step's queries (causal among themselves)

    grid (B, cdiv(max_query_len, M), H): program (b, m, h) takes queries [m*M, (m+1)*M) of row b for
    head h and walks the context tiles up to its last query's position, each tile gathered through
    block_tables[b]. A decode token is the case q_len = 1, so mixed batches run here too.

A row with seq_lens[b] == 0 (padding) writes zeros for its tokens.

Measured on the H200 (2026-11-30, tests/gpu/decode_attention_timing.py): 4 fresh prompts of 4096 tokens,
32:4 heads, D 128, bf16: 2.07 ms a layer (265 TFLOP/s) against 0.93 ms for torch's SDPA on contiguous
tensors. Not yet done: packing a GQA group into one program (each K/V tile is now loaded once per query
head), skipping the causal mask off the diagonal, and autotuning tiles per shape.
"""

from __future__ import annotations

import torch

from fastdeploy_r3.model_executor.ops.paged_tiles import (
    LOG2E,
    check_paged_attention_args,
    dot_block,
    kv_tile,
    normalize,
    online_softmax_step,
    tile_scores,
)
from fastdeploy_r3.model_executor.ops.triton_setup import INTERPRET, jit, tl, triton


@jit
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [NB, BS, KVH, D]
    v_cache_ptr,  # [NB, BS, KVH, D]
    block_tables_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    out_ptr,  # [T, H, D]
    scale_log2,
    stride_q_t,
    stride_q_h,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt,
    stride_o_t,
    stride_o_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + b + 1).to(tl.int64) - q_start
    m0 = m_block * BLOCK_M
    if m0 < q_len:
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
        ctx_len = seq_len - q_len  # tokens before this step's queries
        kv_head = head // GROUP
        m = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index within the row
        d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        m_mask = m < q_len
        d_mask = d < HEAD_DIM
        q_offs = (q_start + m)[:, None] * stride_q_t + head * stride_q_h + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        q_pos = ctx_len + m  # [BLOCK_M] absolute positions

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        hi = tl.minimum(seq_len, ctx_len + m0 + BLOCK_M)  # causal: no query here sees past this
        for start in range(0, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions
            n_mask = pos < hi
            kv_offs, kv_mask = kv_tile(
                block_tables_ptr, b, stride_bt, pos, n_mask, kv_head, d, d_mask,
                stride_c_block, stride_c_slot, stride_c_head, BLOCK_SIZE,
            )  # fmt: skip
            s = tile_scores(q, k_cache_ptr, kv_offs, kv_mask, scale_log2, UPCAST)  # [BLOCK_M, BLOCK_N]
            visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]  # [BLOCK_M, BLOCK_N]
            s = tl.where(visible, s, float("-inf"))
            m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v_cache_ptr, kv_offs, kv_mask, q.dtype, True, UPCAST)

        out, _ = normalize(acc, l_i)  # [BLOCK_M, BLOCK_D]
        o_offs = (q_start + m)[:, None] * stride_o_t + head * stride_o_h + d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    scale: float,
    out: torch.Tensor,  # [T, H, D]
    max_query_len: int,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """Causal attention of each row's query tokens over its whole context (prefix hits, chunks, decode)."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_rows = seq_lens.shape[0]
    check_paged_attention_args("paged_prefill_attention", q, k_cache, v_cache, block_tables, seq_lens,
                               query_start_loc, out)
    if num_rows == 0 or max_query_len == 0:
        return out
    block_m = min(block_m, dot_block(max_query_len))
    grid = (num_rows, triton.cdiv(max_query_len, block_m), num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_D=dot_block(head_dim), BLOCK_N=block_n, UPCAST=INTERPRET,
        num_warps=num_warps,
    )  # fmt: skip
    return out
