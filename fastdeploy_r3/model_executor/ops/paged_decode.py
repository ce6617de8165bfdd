"""Paged decode attention for the whole batch in one launch (GQA, split-KV), plus its reduction.

Shape legend: B = batch rows (a fixed capacity under CUDA graphs), T = tokens, H = query heads,
KVH = kv heads, G = H // KVH, D = head_dim, NB / BS = cache blocks / block size, P = KV splits.

    grid (B, KVH, P): program (b, h, p) takes row b's one query token, its G query heads that read kv
    head h (packed as the M dimension of the dot: GQA reads each K/V tile once for the whole group),
    and context positions [p * part_b, min((p + 1) * part_b, seq_lens[b])), read through block_tables[b],
    where part_b = seq_lens[b] / P rounded up to a multiple of BLOCK_N: each row's own context is cut
    into P pieces, read on the device, so a CUDA graph captured for max_model_len (P sized for the
    longest context it may see) still spreads a short context over all P programs.

    P == 1: the program writes out[t] directly.
    P > 1:  it writes a normalised partial output and its log-sum-exp (base 2), then counts itself in on
            the arrival counter of (b, h) (ops/arrivals.py); the one that arrives last combines the P
            partials of the G heads in split order (a launch fewer a layer than the second reduction
            kernel, which remains for fused_reduce=False or when no counters are at hand).

Everything the kernels read about the batch lives in device tensors of fixed shape (seq_lens [B],
query_start_loc [B + 1], block_tables [B, max_blocks]), so a replayed CUDA graph needs no host work.
A row with query_start_loc[b + 1] == query_start_loc[b] writes nothing; a row with seq_lens[b] == 0
(padding) writes zeros. The split count is a host integer fixed at launch.

Measured on the H200 (2026-11-30, tests/gpu/decode_attention_timing.py; 32:4 heads, D 128, bf16, block
16, context 1024, 48 layers in one graph): 7.3 / 18.6 / 41.4 / 130.3 µs a layer at batch 1 / 16 / 64 /
256, i.e. 14.5 / 2.3 / 1.29 / 1.01 x the bytes-over-bandwidth roofline (batch 1 is launch-bound).
Before the partition followed each row's length (2026-12-03), it was max_seq_len / P: a server's decode
graphs, captured for max_model_len 40,960, read a 1,024-token context in one of the 16 splits: its
batch-1 decode step took 5.35 ms against bench_r3's 4.42 (whose max_seq_len is the prompt's); 3.73 after.
In the batch-1 step of Qwen3-30B-A3B (2026-12-03, torch.profiler): 7.0 us a layer for the split kernel and
1.7 for the reduction launch, 8.4 for the split kernel that combines its own splits (and one gap fewer).
"""

from __future__ import annotations

import torch

from fastdeploy_r3.model_executor.ops.arrivals import arrival_counters
from fastdeploy_r3.model_executor.ops.paged_tiles import (
    LOG2E,
    check_paged_attention_args,
    dot_block,
    kv_tile,
    normalize,
    online_softmax_step,
    tile_scores,
)
from fastdeploy_r3.model_executor.ops.triton_setup import INTERPRET, jit, num_sms, pdl, pdl_prologue, tl, triton

SHORT_QUERY_MAX = 8  # the most query tokens a row may have for the short-query path (k + 1)
# shortest split: on the H200 (2026-11-30, 32:4 heads, D 128, context 1024) batch 1 took 12.4 µs a layer with 4
# splits of 256 and 7.2 µs with 16 of 64; batch 64 41.8 µs with 2 splits, 44.4 with 1
MIN_PARTITION = 64
MAX_SPLITS = 16


@jit
def _decode_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [NB, BS, KVH, D]
    v_cache_ptr,  # [NB, BS, KVH, D]
    block_tables_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    out_ptr,  # [T, H, D]                      written when NUM_SPLITS == 1
    part_out_ptr,  # [B, H, NUM_SPLITS, D] f32  written when NUM_SPLITS > 1
    part_lse_ptr,  # [B, H, NUM_SPLITS] f32
    arrivals_ptr,  # [B, KVH] int32, zero between launches (FUSED_REDUCE)
    scale_log2,  # softmax scale * log2(e)
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
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)  # the output projection may stream its weights meanwhile (ops/triton_setup.py)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b).to(tl.int64)
    q_end = tl.load(query_start_loc_ptr + b + 1).to(tl.int64)
    if q_end > q_start:
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
        g = tl.arange(0, BLOCK_G)  # [BLOCK_G]
        d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        heads = kv_head * GROUP + g  # [BLOCK_G]
        g_mask = g < GROUP
        d_mask = d < HEAD_DIM
        q_offs = q_start * stride_q_t + heads[:, None] * stride_q_h + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

        # this row's context in NUM_SPLITS pieces of whole BLOCK_N tiles (the last ones may be empty)
        partition = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split.to(tl.int64) * partition
        hi = tl.minimum(seq_len, lo + partition)
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)  # running max (base 2)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)  # running sum of exp2
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions
            n_mask = pos < hi
            kv_offs, kv_mask = kv_tile(
                block_tables_ptr, b, stride_bt, pos, n_mask, kv_head, d, d_mask,
                stride_c_block, stride_c_slot, stride_c_head, BLOCK_SIZE,
            )  # fmt: skip
            s = tile_scores(q, k_cache_ptr, kv_offs, kv_mask, scale_log2, UPCAST)  # [BLOCK_G, BLOCK_N]
            s = tl.where(n_mask[None, :], s, float("-inf"))
            # every tile of [lo, hi) holds a key for every head: no row of it is empty
            m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v_cache_ptr, kv_offs, kv_mask, q.dtype, False, UPCAST)

        out, has_ctx = normalize(acc, l_i)  # [BLOCK_G, BLOCK_D]; an empty split (or a padded row) has no keys
        out_mask = g_mask[:, None] & d_mask[None, :]
        if NUM_SPLITS == 1:
            o_offs = q_start * stride_o_t + heads[:, None] * stride_o_h + d[None, :]
            tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            part_row = (b * (GROUP * tl.num_programs(1)) + heads).to(tl.int64) * NUM_SPLITS + split  # [BLOCK_G]
            tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + d[None, :], out, mask=out_mask)
            lse = tl.where(has_ctx, m_i + tl.log2(tl.where(has_ctx, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + part_row, lse, mask=g_mask)
            if FUSED_REDUCE:  # the last of the row's NUM_SPLITS programs for this kv head combines them
                tl.debug_barrier()  # all of this program's partial stores come before its arrival
                arrival = arrivals_ptr + b * tl.num_programs(1) + kv_head
                if tl.atomic_add(arrival, 1, sem="acq_rel") == NUM_SPLITS - 1:
                    tl.store(arrival, 0)  # zero again for the next launch (the only program still counting)
                    first = (b * (GROUP * tl.num_programs(1)) + heads).to(tl.int64) * NUM_SPLITS  # [BLOCK_G]
                    _combine_splits(part_out_ptr, part_lse_ptr, first, g_mask, out_ptr,
                                    q_start * stride_o_t + heads * stride_o_h, HEAD_DIM, NUM_SPLITS, BLOCK_S, BLOCK_D)


@jit
def _combine_splits(part_out_ptr, part_lse_ptr, first, row_mask, out_ptr, out_offs,
                    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[r] = the NUM_SPLITS partials of row r weighted by exp2(lse - max lse), for the rows (heads) at
    partial index first [R] (each followed by its splits), written at out_offs [R]. Loads skip L1 (.cg):
    other programs wrote the partials. An empty split (lse -inf) weighs nothing; all empty gives zeros."""
    s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    s_mask = row_mask[:, None] & (s[None, :] < NUM_SPLITS)  # [R, BLOCK_S]
    lse = tl.load(part_lse_ptr + first[:, None] + s[None, :], mask=s_mask, other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, 1)  # [R]
    w = tl.where(lse > float("-inf"), tl.exp2(lse - tl.where(m > float("-inf"), m, 0.0)[:, None]), 0.0)  # [R, S]
    mask = s_mask[:, :, None] & (d[None, None, :] < HEAD_DIM)  # [R, BLOCK_S, BLOCK_D]
    parts = tl.load(part_out_ptr + (first[:, None] + s[None, :])[:, :, None] * HEAD_DIM + d[None, None, :],
                    mask=mask, other=0.0, cache_modifier=".cg")  # fmt: skip
    total = tl.sum(w, 1)  # [R]
    out = tl.sum(parts * w[:, :, None], 1) / tl.where(total > 0.0, total, 1.0)[:, None]  # [R, BLOCK_D]
    tl.store(out_ptr + out_offs[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (d[None, :] < HEAD_DIM))


@jit
def _reduce_splits_kernel(
    part_out_ptr,  # [B, H, NUM_SPLITS, D] f32
    part_lse_ptr,  # [B, H, NUM_SPLITS] f32
    query_start_loc_ptr,  # [B + 1]
    out_ptr,  # [T, H, D]
    stride_o_t,
    stride_o_h,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + b).to(tl.int64)
    q_end = tl.load(query_start_loc_ptr + b + 1).to(tl.int64)
    if q_end > q_start:
        first = (b * tl.num_programs(1) + head + tl.arange(0, 1)).to(tl.int64) * NUM_SPLITS  # [1]
        _combine_splits(part_out_ptr, part_lse_ptr, first, first >= 0, out_ptr,
                        q_start * stride_o_t + head * stride_o_h + tl.zeros([1], tl.int64),
                        HEAD_DIM, NUM_SPLITS, BLOCK_S, BLOCK_D)  # fmt: skip


def choose_num_splits(num_rows: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough (row, kv head, split) programs to cover the GPU about twice, none shorter than MIN_PARTITION.

    A function of host integers only, so a CUDA graph captured at (num_rows, max_seq_len) keeps it.
    """
    programs = num_rows * num_kv_heads
    by_length = max_seq_len // MIN_PARTITION
    return max(1, min(MAX_SPLITS, by_length, -(-2 * num_sms(device) // max(programs, 1))))


def paged_decode_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    scale: float,
    out: torch.Tensor,  # [T, H, D]
    max_seq_len: int,
    num_splits: int | None = None,
    block_n: int = 64,
    fused_reduce: bool = True,
) -> torch.Tensor:
    """Attention of each row's one new token over its context; the token's k/v are already in the cache.

    max_seq_len bounds seq_lens (under a CUDA graph: the longest context the graph will ever see); it
    sizes the splits. num_splits=None picks them with choose_num_splits. fused_reduce: split partials are
    combined by the last split program of each (row, kv head) to finish, else by a second launch.
    """
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_rows = seq_lens.shape[0]
    check_paged_attention_args("paged_decode_attention", q, k_cache, v_cache, block_tables, seq_lens,
                               query_start_loc, out)
    if num_rows == 0:
        return out
    group = num_heads // num_kv_heads
    splits = num_splits or choose_num_splits(num_rows, num_kv_heads, max_seq_len, q.device)
    if splits > 1:
        part_out = torch.empty((num_rows, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_rows, num_heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # never touched
    block_d = dot_block(head_dim)
    arrivals = arrival_counters(q.device, num_rows * num_kv_heads) if splits > 1 and fused_reduce else None
    early = pdl(q)
    _decode_kernel[(num_rows, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, part_out, part_lse,
        part_lse if arrivals is None else arrivals, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, NUM_SPLITS=splits,
        BLOCK_G=dot_block(group), BLOCK_D=block_d, BLOCK_N=block_n, UPCAST=INTERPRET,
        FUSED_REDUCE=arrivals is not None, BLOCK_S=triton.next_power_of_2(splits), PDL=early, launch_pdl=early,
    )  # fmt: skip
    if splits > 1 and arrivals is None:
        _reduce_splits_kernel[(num_rows, num_heads)](
            part_out, part_lse, query_start_loc, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
            PDL=early, launch_pdl=early,
        )  # fmt: skip
    return out


def short_query_rows(
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decode kernel's metadata for a batch whose rows have a few query tokens each (a speculative
    verify step: k + 1 per row): one row per token, over the causal prefix that token sees.

    Token i of a row with q queries and context seq_len sits at position seq_len - q + i and attends to
    [0, seq_len - q + i] (the prefill kernel's causal rule), so it is a decode row of its own with
    seq_len - (q - 1 - i) positions and the row's block table. Device ops of fixed shape only (no host
    sync): a CUDA graph captures them. Returns block_tables [T, max_blocks], seq_lens [T],
    query_start_loc [T + 1]."""
    tok = torch.arange(num_tokens, dtype=query_start_loc.dtype, device=query_start_loc.device)  # [T]
    row = torch.searchsorted(query_start_loc[1:], tok, right=True).clamp_(max=seq_lens.shape[0] - 1)  # [T]
    start = query_start_loc[row]  # [T]
    q_len = query_start_loc[row + 1] - start  # [T]
    tok_seq_lens = (seq_lens[row] - (q_len - 1 - (tok - start))).clamp_(min=0).to(seq_lens.dtype)  # [T]
    tok_start_loc = torch.arange(num_tokens + 1, dtype=query_start_loc.dtype, device=query_start_loc.device)
    return block_tables.index_select(0, row), tok_seq_lens, tok_start_loc


def use_short_query_decode(num_rows: int, num_kv_heads: int, max_query_len: int, device: torch.device) -> bool:
    """Whether rows of max_query_len (> 1) tokens go through the decode kernel one token a row: when the
    prefill kernel's one program per (row, kv head) over the whole context would leave the GPU mostly
    idle (a verify step at small batch), and the queries are few (each token rereads its row's K/V)."""
    return 1 < max_query_len <= SHORT_QUERY_MAX and num_rows * num_kv_heads < 2 * num_sms(device)
