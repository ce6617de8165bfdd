"""ops/invariant_attention.py, the GQA-packed batch-invariant attention kernel, under the Triton interpreter.

A program holds packed_tokens(G) query tokens times the G heads of one kv head, and folds the context's
partitions of PARTITION (256) positions in order. The stories: the kernel equals the torch oracle on ragged
batches (prefix hits, decode rows, padded rows) for groups that fill its 16 rows exactly (2, 8), leave some
empty (3: 5 tokens x 3 heads = 15 rows) and need more than 16 rows (32: one token a program); a decode step
split over the partitions gives the one-pass kernel's bits; and a request's rows get the same bits alone,
chunked, and decoded among others, also across a partition boundary.
"""

from __future__ import annotations

import pytest
from triton_interpreted import run_interpreted

from fastdeploy_r3.model_executor.ops.invariant_attention import PACKED_ROWS, packed_tokens

pytest.importorskip("triton")

PRELUDE = """
import torch
from fastdeploy_r3.model_executor.ops import triton_setup
from fastdeploy_r3.model_executor.ops.invariant_attention import packed_paged_attention
from fastdeploy_r3.model_executor.ops.kv_cache_write import write_kv_cache
from paged_attention_cases import make_case, run_torch
assert triton_setup.INTERPRET  # really the interpreted kernel

def packed(case, split=None, max_seq_len=None):
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    m = case.meta
    write_kv_cache(case.k, case.v, k_cache, v_cache, m.slot_mapping)
    out = torch.empty_like(case.q)
    packed_paged_attention(case.q, k_cache, v_cache, m.block_tables, m.seq_lens_tensor,
                           m.query_start_loc_tensor, case.scale, out, max_query_len=m.max_query_len,
                           max_seq_len=max_seq_len or m.max_seq_len, split=split, block_n=16)
    return out
"""


def _run_interpreted(body: str) -> None:
    run_interpreted(body, PRELUDE)


def test_tokens_per_program_fill_sixteen_rows_and_never_drop_below_one() -> None:
    assert PACKED_ROWS == 16
    assert [packed_tokens(g) for g in (1, 2, 3, 4, 8, 16, 32)] == [16, 8, 5, 4, 2, 1, 1]


def test_packed_kernel_matches_torch_on_ragged_batches_for_every_group_shape() -> None:
    """Fresh prompts, a prefix hit, decode rows, an empty row and two padded rows (zeros out); groups 2, 3,
    8 and 32 (rows 16, 15 of 16, 16, 32); float32 and bf16."""
    _run_interpreted("""
        rows = [(0, 9), (12, 5), (30, 1), (0, 0), (7, 20), (16, 3)]
        tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
        for heads, kv_heads in ((4, 2), (6, 2), (8, 1), (32, 1)):
            for dtype in (torch.float32, torch.bfloat16):
                case = make_case(rows, num_heads=heads, num_kv_heads=kv_heads, dtype=dtype, padded_rows=2, seed=heads)
                want, _, _ = run_torch(case)
                got = packed(case)
                real = case.real_tokens
                err = (got[:real].float() - want[:real].float()).abs().max().item()
                assert err < tol[dtype], (heads, kv_heads, dtype, err)
                assert torch.equal(got[real:], torch.zeros_like(got[real:]))
    """)


def test_a_decode_step_split_over_partitions_gives_the_one_pass_bits() -> None:
    """Decode rows with contexts of 1, 200, 256, 257 and 700 positions (one, two and three partitions, the
    boundaries on both sides) and a padded row: the split path (a program per partition, a second launch
    folding them) and the one-pass path give the same bits, and the oracle's numbers, also when the split
    is sized for a far longer context than any row has."""
    _run_interpreted("""
        from fastdeploy_r3.model_executor.ops.invariant_attention import PARTITION
        assert PARTITION == 256
        rows = [(0, 1), (199, 1), (255, 1), (256, 1), (699, 1)]
        for heads, kv_heads in ((6, 2), (8, 1)):
            for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
                case = make_case(rows, num_heads=heads, num_kv_heads=kv_heads, dtype=dtype, padded_rows=1,
                                 block_size=16, seed=heads)
                split, one_pass = packed(case, split=True), packed(case, split=False)
                assert torch.equal(split, one_pass), (heads, dtype)
                want, _, _ = run_torch(case)
                real = case.real_tokens
                assert (split[:real].float() - want[:real].float()).abs().max().item() < tol, (heads, dtype)
                assert torch.equal(split[real:], torch.zeros_like(split[real:]))
                assert torch.equal(packed(case), split)  # few rows, several partitions: split by default
                if dtype == torch.float32:  # once per head layout: 16 partitions run slowly when interpreted
                    # a CUDA graph sizes the split for its longest context (16 partitions): the partials past
                    # a row's context are neither written nor folded, and the bits stay
                    assert torch.equal(packed(case, split=True, max_seq_len=4096), split)
    """)


def test_a_request_gets_the_same_bits_alone_chunked_and_decoded_among_others() -> None:
    """Request 0 (a 21-token context, bf16, groups 3 and 8): its rows computed in one step alone, in
    three chunks each shared with other rows, and its last token decoded among other decode rows.

    The chunks start at tokens 0, 10 and 20, multiples of both groups' tokens per program (5 and 2), so a
    token keeps its place in its program's tile: under the interpreter tl.dot is numpy's matmul, whose
    row bits can depend on the row's place in the tile on an AVX-512 BLAS. On the GPU a token lands
    anywhere in a tile (tests/gpu/test_deterministic_gpu.py)."""
    _run_interpreted("""
        g = torch.Generator().manual_seed(5)
        for heads, kv_heads in ((6, 2), (16, 2)):
            n, bs, d = 21, 4, 16
            q = torch.randn(n, heads, d, generator=g).bfloat16()
            k = torch.randn(n, kv_heads, d, generator=g).bfloat16()
            v = torch.randn(n, kv_heads, d, generator=g).bfloat16()
            k_cache = torch.zeros(64, bs, kv_heads, d, dtype=torch.bfloat16)
            v_cache = torch.zeros_like(k_cache)
            table = torch.arange(8)  # request 0's blocks; others get blocks 8.. (noise)
            k_cache[8:] = torch.randn(56, bs, kv_heads, d, generator=g)
            v_cache[8:] = torch.randn(56, bs, kv_heads, d, generator=g)
            slots = table[torch.arange(n) // bs] * bs + torch.arange(n) % bs
            k_cache.view(-1, kv_heads, d)[slots] = k
            v_cache.view(-1, kv_heads, d)[slots] = v

            def step(parts):
                # parts: (table, seq_len, q rows); every row's KV is already in the cache
                qs = torch.cat([p[2] for p in parts])
                starts = torch.tensor([0] + [len(p[2]) for p in parts]).cumsum(0)
                width = max(len(p[0]) for p in parts)
                tables = torch.stack([torch.cat([p[0], p[0][-1:].repeat(width - len(p[0]))]) for p in parts])
                out = torch.empty_like(qs)
                packed_paged_attention(qs, k_cache, v_cache, tables, torch.tensor([p[1] for p in parts]),
                                       starts, d**-0.5, out, max_query_len=max(len(p[2]) for p in parts), block_n=16)
                return out.split([len(p[2]) for p in parts])

            def other(i, ctx, m):  # request 1 + i: blocks 8 + 6 i .., ctx tokens, its last m queries
                return torch.arange(8 + 6 * i, 14 + 6 * i), ctx, torch.randn(m, heads, d, generator=g).bfloat16()

            alone = step([(table, n, q)])[0]
            chunked = torch.cat([step([other(0, 7, 3), (table, 10, q[:10]), other(1, 19, 19)])[1],
                                 step([other(2, 2, 1), (table, 20, q[10:20])])[1],
                                 step([other(3, 11, 2), other(4, 24, 1), (table, n, q[20:])])[2]])
            decoded = step([other(5, 9, 1), (table, n, q[-1:]), other(6, 20, 1), other(7, 3, 1)])[1]
            assert torch.equal(chunked, alone), heads
            assert torch.equal(decoded, alone[-1:]), heads
    """)
