"""Batch-invariant paged attention: a GQA group per program, the context in partitions of fixed positions.

Deterministic mode (model_executor/batch_invariant.py) needs a query's output to depend on its position and
its context only. Two things make that cheap here:

- Packing. A program holds TOKENS consecutive query tokens of one row times the GROUP heads that share a
  kv head, so each K/V tile is read once per kv head (one query head per program read it GROUP times: 8x
  for Qwen3-30B-A3B's 32:4 heads). TOKENS and BLOCK_R are fixed by the model's head counts
  (packed_tokens), never by the batch.

      program (t, b, h): rows r = 0 .. TOKENS * GROUP - 1 of one [BLOCK_R, D] tile
          token  t * TOKENS + r // GROUP      (of row b's query_lens[b] tokens)
          head   h * GROUP + r % GROUP

- Partitions. A query's context is cut at fixed absolute positions, [0, P), [P, 2P), ... (P = PARTITION);
  each partition's softmax partial (m, l, acc) starts fresh and walks its tiles of BLOCK_N in order,
  masking positions past the query; the partials are folded left to right (fold()), skipping a
  partition the query sees nothing of. The result is the same whichever program computes a partial:

      one pass        a program walks its partitions itself and folds as it goes (any step)
      split           a program per (partition, ...) writes its partial, a second launch folds them in
                      the same order (decode steps of few rows, which one pass would leave to a handful
                      of programs walking the whole context)

  Both paths run the same @jit partial() and fold() with floating-point contraction off, so a query gets
  the same bits from either: a decode step may take the split and a recompute the one pass.

A tile or partition past a row's position is masked whole: it adds exactly 0 and rescales by exactly 1 (the
row saw position 0 in tile 0), so how far a program walks does not matter.
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
PARTITION = 256  # context positions per partition (a multiple of every BLOCK_N used)
FOLD_HEADS = 4  # heads a fold program holds (a fold is per row: any grouping gives the same bits)
SPLIT_BELOW_PROGRAMS = 132  # split a decode step of fewer (row, kv head) programs than the H200 has SMs


def packed_tokens(group: int) -> int:
    """Query tokens per program for a GQA group of `group` heads: as many as fill PACKED_ROWS rows, at least 1."""
    return max(1, PACKED_ROWS // group)


@jit
def _partial(q, q_pos, k_cache_ptr, v_cache_ptr, block_tables_ptr, b, stride_bt, kv_head, d, d_mask,
             stride_c_block, stride_c_slot, stride_c_head, scale_log2, p_start, p_end,
             BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
             UPCAST: tl.constexpr):  # fmt: skip
    """The softmax partial (m [R], l [R], acc [R, D]) of rows q [R, D] over context positions [p_start, p_end).
    The one-pass branch of _packed_kernel advances its partition's partial with these very steps."""
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for start in range(p_start, p_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions
        n_mask = pos < p_end
        kv_offs, kv_mask = kv_tile(
            block_tables_ptr, b, stride_bt, pos, n_mask, kv_head, d, d_mask,
            stride_c_block, stride_c_slot, stride_c_head, BLOCK_SIZE,
        )  # fmt: skip
        s = tile_scores(q, k_cache_ptr, kv_offs, kv_mask, scale_log2, UPCAST)  # [BLOCK_R, BLOCK_N]
        visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]  # [BLOCK_R, BLOCK_N]
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v_cache_ptr, kv_offs, kv_mask, q.dtype, True, UPCAST)
    return m_i, l_i, acc


@jit
def fold(m_run, l_run, acc_run, m_p, l_p, acc_p):
    """Fold partition p's partial into the running one, per row; a row that saw nothing in p is unchanged.
    The first partition a row sees comes through exactly (the running acc and l are 0, scaled by 0)."""
    seen = l_p > 0.0  # [R]
    m_new = tl.where(seen, tl.maximum(m_run, m_p), 0.0)  # 0 where unused: no -inf - -inf
    run_scale = tl.exp2(m_run - m_new)  # 0 while nothing ran (m_run = -inf)
    p_scale = tl.exp2(m_p - m_new)
    m_out = tl.where(seen, m_new, m_run)
    l_out = tl.where(seen, l_run * run_scale + l_p * p_scale, l_run)
    acc_out = tl.where(seen[:, None], acc_run * run_scale[:, None] + acc_p * p_scale[:, None], acc_run)
    return m_out, l_out, acc_out


@jit
def _packed_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [NB, BS, KVH, D]
    v_cache_ptr,  # [NB, BS, KVH, D]
    block_tables_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    out_ptr,  # one pass: [T, H, D]; split: the partials' acc [T, H, NP, D] float32
    ml_ptr,  # split: the partials' (m, l) [T, H, NP, 2] float32 (one pass: unused)
    # (split: stride_o_t / stride_o_h count partials, H * NP and NP)
    seen_parts_ptr,  # split: [T] int32, the partitions token t sees (one pass: unused)
    scale_log2,
    stride_q_t,
    stride_q_h,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt,
    stride_o_t,
    stride_o_h,
    num_parts,  # split: NP
    GROUP: tl.constexpr,
    TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    t0 = tl.program_id(0) * TOKENS
    b = tl.program_id(1)
    kv_head = tl.program_id(2)
    if SPLIT:
        kv_head = tl.program_id(2) // num_parts
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
        hi = tl.minimum(seq_len, ctx_len + t0 + TOKENS)  # causal: no row here sees past this
        if SPLIT:
            part = tl.program_id(2) % num_parts
            p_start = part * PARTITION
            if (part == 0) & (kv_head == 0):  # the fold reads partitions [0, seen) of each token, no more
                seen = (q_pos + PARTITION) // PARTITION  # ceil((q_pos + 1) / P); 0 for a padded row (q_pos -1)
                tl.store(seen_parts_ptr + q_start + tok, seen.to(tl.int32), mask=r_mask)
            if p_start < hi:  # a partition past every token here is neither computed nor read
                m_p, l_p, acc_p = _partial(
                    q, q_pos, k_cache_ptr, v_cache_ptr, block_tables_ptr, b, stride_bt, kv_head, d, d_mask,
                    stride_c_block, stride_c_slot, stride_c_head, scale_log2, p_start,
                    tl.minimum(p_start + PARTITION, hi), BLOCK_R, BLOCK_D, BLOCK_N, BLOCK_SIZE, UPCAST,
                )  # fmt: skip
                slot = (q_start + tok) * stride_o_t + head * stride_o_h + part  # [BLOCK_R] (token, head, part)
                tl.store(out_ptr + slot[:, None] * HEAD_DIM + d[None, :], acc_p,
                         mask=r_mask[:, None] & d_mask[None, :])  # fmt: skip
                tl.store(ml_ptr + slot * 2, m_p, mask=r_mask)
                tl.store(ml_ptr + slot * 2 + 1, l_p, mask=r_mask)
        else:
            # one flat loop over the tiles (a loop per partition would restart the load pipeline every few
            # tiles): the partition's partial (m_p, l_p, acc_p) advances exactly as _partial's does, and is
            # folded into the running one after a partition's last tile
            m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
            acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
            m_p = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
            l_p = tl.zeros([BLOCK_R], dtype=tl.float32)
            acc_p = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
            for start in range(0, hi, BLOCK_N):
                pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]; a tile never spans two partitions
                n_mask = pos < hi
                kv_offs, kv_mask = kv_tile(
                    block_tables_ptr, b, stride_bt, pos, n_mask, kv_head, d, d_mask,
                    stride_c_block, stride_c_slot, stride_c_head, BLOCK_SIZE,
                )  # fmt: skip
                s = tile_scores(q, k_cache_ptr, kv_offs, kv_mask, scale_log2, UPCAST)  # [BLOCK_R, BLOCK_N]
                visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]  # [BLOCK_R, BLOCK_N]
                s = tl.where(visible, s, float("-inf"))
                m_p, l_p, acc_p = online_softmax_step(s, m_p, l_p, acc_p, v_cache_ptr, kv_offs, kv_mask, q.dtype,
                                                      True, UPCAST)  # fmt: skip
                if ((start + BLOCK_N) % PARTITION == 0) | (start + BLOCK_N >= hi):
                    m_i, l_i, acc = fold(m_i, l_i, acc, m_p, l_p, acc_p)
                    m_p = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
                    l_p = tl.zeros([BLOCK_R], dtype=tl.float32)
                    acc_p = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
            out, _ = normalize(acc, l_i)  # [BLOCK_R, BLOCK_D]
            o_offs = (q_start + tok)[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :]
            tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


@jit
def _fold_parts_kernel(
    acc_ptr,  # [T, H, NP, D] float32
    ml_ptr,  # [T, H, NP, 2] float32
    seen_parts_ptr,  # [T] int32
    out_ptr,  # [T, H, D]
    num_parts,
    stride_o_t,
    stride_o_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (t, j): heads [j * BLOCK_H, (j + 1) * BLOCK_H) of token t, the partitions it sees folded in
    order, as the one-pass kernel folds them (a partition past the token would be skipped there too: the
    loop stops at it instead of reading the unwritten partials of a context that a CUDA graph sized for
    the longest one)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    h_mask = h < NUM_HEADS
    d_mask = d < HEAD_DIM
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    seen = tl.load(seen_parts_ptr + t)
    for part in range(0, seen):
        slot = (t * NUM_HEADS + h) * num_parts + part  # [BLOCK_H]
        m_p = tl.load(ml_ptr + slot * 2, mask=h_mask, other=float("-inf"))
        l_p = tl.load(ml_ptr + slot * 2 + 1, mask=h_mask, other=0.0)
        acc_p = tl.load(acc_ptr + slot[:, None] * HEAD_DIM + d[None, :], mask=h_mask[:, None] & d_mask[None, :],
                        other=0.0)  # fmt: skip
        m_i, l_i, acc = fold(m_i, l_i, acc, m_p, l_p, acc_p)
    out, _ = normalize(acc, l_i)
    o_offs = t * stride_o_t + h[:, None] * stride_o_h + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


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
    max_seq_len: int | None = None,
    split: bool | None = None,
    block_n: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """Causal attention of each row's query tokens over its context, a GQA group per program (batch-invariant).

    max_seq_len bounds seq_lens (under a CUDA graph: the longest context it will see); with it, a decode
    step (max_query_len 1) of few (row, kv head) programs takes the split path, unless `split` says which
    (tests). Both paths give the same bits."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_rows = seq_lens.shape[0]
    check_paged_attention_args("packed_paged_attention", q, k_cache, v_cache, block_tables, seq_lens,
                               query_start_loc, out)  # fmt: skip
    if num_rows == 0 or max_query_len == 0:
        return out
    if PARTITION % block_n:
        raise ValueError(f"packed_paged_attention: block_n {block_n} must divide the partition of {PARTITION}")
    group = num_heads // num_kv_heads
    tokens = packed_tokens(group)
    num_parts = triton.cdiv(max_seq_len, PARTITION) if max_seq_len else 1
    if split is None:
        split = max_query_len == 1 and num_parts > 1 and num_rows * num_kv_heads < SPLIT_BELOW_PROGRAMS
    if split and not max_seq_len:
        raise ValueError("packed_paged_attention: the split path needs max_seq_len")
    num_tokens = q.shape[0]
    if split:  # partials [T, H, NP, D] and their (m, l), folded by a second launch
        dest = torch.empty(num_tokens, num_heads, num_parts, head_dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(num_tokens, num_heads, num_parts, 2, dtype=torch.float32, device=q.device)
        strides = (num_heads * num_parts, num_parts)  # in partials: the kernel's stride_o_t / stride_o_h
        seen_parts = torch.empty(num_tokens, dtype=torch.int32, device=q.device)
    else:
        dest, ml, seen_parts, strides = out, out, out, (out.stride(0), out.stride(1))
    # token groups on the first axis: a long chunk of one row may need more than the 65535 of the others
    grid = (triton.cdiv(max_query_len, tokens), num_rows, num_kv_heads * (num_parts if split else 1))
    # contraction off: the fold's multiply-adds stay two roundings in both paths, whatever the compiler fuses
    fp = {} if INTERPRET else {"enable_fp_fusion": False}
    _packed_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, dest, ml, seen_parts, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), *strides, num_parts,
        GROUP=group, TOKENS=tokens, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_R=dot_block(tokens * group), BLOCK_D=dot_block(head_dim), BLOCK_N=block_n, PARTITION=PARTITION,
        SPLIT=split, UPCAST=INTERPRET, num_warps=num_warps, **fp,
    )  # fmt: skip
    if split:
        heads_per = min(FOLD_HEADS, triton.next_power_of_2(num_heads))
        _fold_parts_kernel[(num_tokens, triton.cdiv(num_heads, heads_per))](
            dest, ml, seen_parts, out, num_parts, out.stride(0), out.stride(1), NUM_HEADS=num_heads,
            HEAD_DIM=head_dim, BLOCK_H=heads_per, BLOCK_D=dot_block(head_dim), num_warps=2, **fp,
        )  # fmt: skip
    return out
