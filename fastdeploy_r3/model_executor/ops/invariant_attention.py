"""Batch-invariant paged attention: one program per (row, token group, kv head), the whole GQA group packed.

Deterministic mode (model_executor/batch_invariant.py) needs a query's output to depend on its position and
its context only. The paged prefill kernel gives that with one tile shape (it walks the context in tiles at
fixed absolute positions and masks past each query), but it holds one query head per program: at a decode
step every K/V tile is read once per query head, GROUP times the bytes the decode kernel reads (8x for
Qwen3-30B-A3B's 32:4 heads). Here a program holds TOKENS consecutive query tokens of one row times the
GROUP heads that share a kv head, so each K/V tile is read once per kv head:

    program (t, b, h): rows r = 0 .. TOKENS * GROUP - 1 of one [BLOCK_R, D] tile
        token  t * TOKENS + r // GROUP      (of row b's query_lens[b] tokens)
        head   h * GROUP + r % GROUP
    walks context tiles [0, N), [N, 2N), ... up to its last token's position, masking per row

TOKENS and BLOCK_R are fixed by the model's head counts (packed_tokens), never by the batch: every step,
prefill, chunk or decode, runs the same tile shapes, so a (token, head) row goes through the same
instructions wherever it lands. A tile past a row's position is masked whole: it adds exactly 0 and
rescales by exactly 1 (the row saw position 0 in tile 0), so how far the program walks does not matter.
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

PACKED_ROWS = 16  # query rows a program holds: the smallest tile tl.dot takes on a GPU


def packed_tokens(group: int) -> int:
    """Query tokens per program for a GQA group of `group` heads: as many as fill PACKED_ROWS rows, at least 1."""
    return max(1, PACKED_ROWS // group)


@jit
def _packed_kernel(
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
    TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    t0 = tl.program_id(0) * TOKENS
    b = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + b + 1).to(tl.int64) - q_start
    if t0 < q_len:
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
        ctx_len = seq_len - q_len  # tokens before this step's queries
        r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
        tok = t0 + r // GROUP  # [BLOCK_R] query index within the row
        head = kv_head * GROUP + r % GROUP  # [BLOCK_R]
        d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        r_mask = (r < TOKENS * GROUP) & (tok < q_len)
        d_mask = d < HEAD_DIM
        q_offs = (q_start + tok)[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=r_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_D]
        q_pos = ctx_len + tok  # [BLOCK_R] absolute positions

        m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        hi = tl.minimum(seq_len, ctx_len + t0 + TOKENS)  # causal: no row here sees past this
        for start in range(0, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions
            n_mask = pos < hi
            kv_offs, kv_mask = kv_tile(
                block_tables_ptr, b, stride_bt, pos, n_mask, kv_head, d, d_mask,
                stride_c_block, stride_c_slot, stride_c_head, BLOCK_SIZE,
            )  # fmt: skip
            s = tile_scores(q, k_cache_ptr, kv_offs, kv_mask, scale_log2, UPCAST)  # [BLOCK_R, BLOCK_N]
            visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]  # [BLOCK_R, BLOCK_N]
            s = tl.where(visible, s, float("-inf"))
            m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v_cache_ptr, kv_offs, kv_mask, q.dtype, True, UPCAST)

        out, _ = normalize(acc, l_i)  # [BLOCK_R, BLOCK_D]
        o_offs = (q_start + tok)[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def packed_paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    scale: float,
    out: torch.Tensor,  # [T, H, D]
    max_query_len: int,
    block_n: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """Causal attention of each row's query tokens over its context, a GQA group per program (batch-invariant)."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_rows = seq_lens.shape[0]
    check_paged_attention_args("packed_paged_attention", q, k_cache, v_cache, block_tables, seq_lens,
                               query_start_loc, out)  # fmt: skip
    if num_rows == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    tokens = packed_tokens(group)
    # token groups on the first axis: a long chunk of one row may need more than the 65535 of the others
    grid = (triton.cdiv(max_query_len, tokens), num_rows, num_kv_heads)
    _packed_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, TOKENS=tokens, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_R=dot_block(tokens * group), BLOCK_D=dot_block(head_dim), BLOCK_N=block_n, UPCAST=INTERPRET,
        num_warps=num_warps,
    )  # fmt: skip
    return out
