"""What the paged decode and prefill kernels share: the K/V tile gather through a block table, the
online-softmax step, the final normalisation, and the host-side argument checks.

Shape legend as in paged_decode.py; R = query rows a program holds (decode: the G heads of one kv head,
prefill: M query tokens of one head), N = context positions per tile.

    tile [start, start + N) of row b's context, kv head h:
        pos      start .. start + N - 1              (masked at hi)
        block    block_tables[b, pos // BS]
        offset   block * stride_block + (pos % BS) * stride_slot + h * stride_head   (+ d: [N, D])

The online softmax works in base 2 (scores already scaled by softmax_scale * log2(e)) and keeps, per
query row, the running max m, the running sum l of exp2(s - m) and the unnormalised output acc.
These are @jit functions: Triton inlines them, so each kernel compiles to the code it had when the
lines were written out in it.
"""

from __future__ import annotations

import torch

from fastdeploy_r3.model_executor.ops.triton_setup import jit, mma, tl

LOG2E = 1.4426950408889634
MIN_DOT_DIM = 16  # tl.dot on a GPU wants every operand dimension >= 16 (the interpreter does not check)


def dot_block(n: int) -> int:
    """A tile dimension that tl.dot takes on a GPU and that holds n: the next power of two, at least 16
    (the head dim of a tiny test model is 8; padded lanes are masked like any tail)."""
    return max(MIN_DOT_DIM, 1 << max(n - 1, 0).bit_length())


@jit
def kv_tile(
    block_tables_ptr,
    b,
    stride_bt,
    pos,  # [BLOCK_N] context positions of row b
    n_mask,  # [BLOCK_N] pos < the row's limit
    kv_head,
    d,  # [BLOCK_D]
    d_mask,  # [BLOCK_D]
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    BLOCK_SIZE: tl.constexpr,
):
    """Offsets [N, D] of the K/V of row b's context positions `pos` for one kv head, and their mask [N, D].

    The caller builds pos and n_mask itself: with them computed here, ptxas scheduled the decode kernel
    (one split, line info on) differently from the hand-inlined original, for the same PTX instructions.
    """
    block_id = tl.load(block_tables_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=n_mask, other=0)
    row = block_id.to(tl.int64) * stride_c_block + (pos % BLOCK_SIZE) * stride_c_slot + kv_head * stride_c_head
    kv_offs = row[:, None] + d[None, :]  # [BLOCK_N, BLOCK_D]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    return kv_offs, kv_mask


@jit
def tile_scores(q, k_cache_ptr, kv_offs, kv_mask, scale_log2, UPCAST: tl.constexpr):
    """q [R, D] against the K tile at kv_offs -> scores [R, N] in base 2 (k cast to q's dtype)."""
    k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    return mma(q, tl.trans(k.to(q.dtype)), UPCAST) * scale_log2  # [R, BLOCK_N]


@jit
def online_softmax_step(
    s,  # [R, N] base-2 scores, -inf where masked
    m_i,  # [R] running max
    l_i,  # [R] running sum
    acc,  # [R, D] float32
    v_cache_ptr,
    kv_offs,
    kv_mask,
    DTYPE: tl.constexpr,  # q's dtype: p and v meet in it, as q and k did
    ROW_MAY_BE_EMPTY: tl.constexpr,  # a query row may see no key in this tile (prefill's causal diagonal)
    UPCAST: tl.constexpr,
):
    """Fold one tile into (m, l, acc): rescale what was there by exp2(m_old - m_new), add exp2(s - m_new) @ V."""
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [R]
    if ROW_MAY_BE_EMPTY:
        # a row that sees nothing yet keeps m = -inf; shift by 0 there instead of by -inf (NaN)
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)  # [R]
        p = tl.exp2(s - shift[:, None])  # [R, N]
        alpha = tl.exp2(m_i - shift)  # [R]
    else:
        p = tl.exp2(s - m_new[:, None])  # [R, N]
        alpha = tl.exp2(m_i - m_new)  # [R]
    v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(DTYPE)  # [BLOCK_N, BLOCK_D]
    acc = acc * alpha[:, None] + mma(p.to(DTYPE), v, UPCAST)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


@jit
def normalize(acc, l_i):
    """acc [R, D] / l [R] -> (out [R, D], has_ctx [R]); a row that saw no key (l = 0) gives zeros."""
    has_ctx = l_i > 0.0
    out = tl.where(has_ctx[:, None], acc / tl.where(has_ctx, l_i, 1.0)[:, None], 0.0)
    return out, has_ctx


def check_paged_attention_args(
    op: str,
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    out: torch.Tensor,  # [T, H, D]
) -> None:
    """Raise ValueError, naming `op`, unless the tensors have the layout both paged kernels read."""
    num_heads, num_kv_heads, num_rows = q.shape[1], k_cache.shape[2], seq_lens.shape[0]
    if num_heads % num_kv_heads or q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError(f"{op}: q {tuple(q.shape)} needs H divisible by KVH={num_kv_heads} "
                         "and q/out with a contiguous last dimension")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(f"{op}: k_cache and v_cache need equal strides, head_dim contiguous")
    if query_start_loc.shape != (num_rows + 1,) or block_tables.shape[0] != num_rows:
        raise ValueError(f"{op}: query_start_loc {tuple(query_start_loc.shape)} and block_tables "
                         f"{tuple(block_tables.shape)} must have {num_rows} (+1) rows like seq_lens")
