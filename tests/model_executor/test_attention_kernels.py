"""The attention / norm / rotary Triton kernels against their torch references, under the Triton interpreter.

TRITON_INTERPRET must be set before triton builds the kernels, so each test runs its body in a fresh
interpreter process (the parent may already have imported triton for other tests). Random batches
come from tests/paged_attention_cases.py: scattered block tables over a cache full of noise (holes),
prefix hits, chunked prefill, decode rows, GQA, padded rows.
"""

from __future__ import annotations

import pytest
from triton_interpreted import run_interpreted

pytest.importorskip("triton")

PRELUDE = """
import torch
from fastdeploy_r3.model_executor.ops import triton_setup
from paged_attention_cases import make_case, run_torch, run_triton
assert triton_setup.INTERPRET  # really the interpreted kernels, not the references
torch.manual_seed(0)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}

def max_err(a, b):
    return (a.float() - b.float()).abs().max().item()
"""


def _run_interpreted(body: str) -> None:
    run_interpreted(body, PRELUDE)


def test_prefill_kernel_matches_torch_on_ragged_batches_with_prefix_hits_and_padding() -> None:
    """Fresh prompts, prefix hits / later chunks, decode rows and empty rows in one batch; three GQA shapes;
    float32 and bf16. Padded rows give zeros and write no KV; every other cache slot equals the oracle's."""
    _run_interpreted("""
        rows = [(0, 9), (12, 5), (30, 1), (0, 0), (7, 20), (16, 3)]
        for heads, kv_heads in ((4, 2), (8, 1), (2, 2)):
            for dtype in (torch.float32, torch.bfloat16):
                case = make_case(rows, num_heads=heads, num_kv_heads=kv_heads, dtype=dtype, padded_rows=2, seed=heads)
                assert case.meta.max_query_len == 20
                want, k_want, v_want = run_torch(case)
                got, k_got, v_got = run_triton(case)
                real = case.real_tokens
                assert max_err(got[:real], want[:real]) < TOL[dtype], (heads, kv_heads, dtype)
                assert torch.equal(got[real:], torch.zeros_like(got[real:]))  # padded rows
                assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
                written = case.meta.slot_mapping[case.meta.slot_mapping >= 0]
                untouched = torch.ones(k_got.shape[0] * k_got.shape[1], dtype=torch.bool)
                untouched[written] = False
                flat = lambda c: c.reshape(-1, *c.shape[2:])
                assert torch.equal(flat(k_got)[untouched], flat(case.k_cache)[untouched])
                assert len(written) == sum(n for _, n in rows)
    """)


def test_prefill_kernel_tiles_long_chunks_across_query_and_context_blocks() -> None:
    """A 70-token chunk after a 45-token prefix with 16-token tiles: several query blocks, each seeing a
    different causal frontier, and context tiles that straddle cache blocks of 4."""
    _run_interpreted("""
        from fastdeploy_r3.model_executor.ops.paged_prefill import paged_prefill_attention
        case = make_case([(45, 70), (0, 33)], num_heads=4, num_kv_heads=2, seed=3)
        want, k_cache, v_cache = run_torch(case)  # its caches hold every token's k/v
        got = torch.empty_like(case.q)
        m = case.meta
        paged_prefill_attention(case.q, k_cache, v_cache, m.block_tables, m.seq_lens_tensor,
                                m.query_start_loc_tensor, case.scale, got, max_query_len=70, block_m=16, block_n=16)
        assert max_err(got, want) < 2e-5
    """)


def test_decode_kernel_matches_torch_for_every_split_count() -> None:
    """One token per row over contexts of 1..63 tokens, split into 1, 2, 3 or 7 partitions of 16 tokens
    (empty partitions included), GQA 8:2 in bf16 and 4:1 in float32, padded rows: zeros. The splits are
    combined by the last split program to arrive, or by the second kernel: the same numbers either way,
    and the arrival counters are all zero again after each launch (the next layer's starts from zero)."""
    _run_interpreted("""
        from fastdeploy_r3.model_executor.ops import arrivals
        rows = [(29, 1), (4, 1), (0, 1), (62, 1), (15, 1)]
        for heads, kv_heads, dtype in ((8, 2, torch.bfloat16), (4, 1, torch.float32)):
            case = make_case(rows, num_heads=heads, num_kv_heads=kv_heads, dtype=dtype, padded_rows=3, seed=7)
            assert case.meta.max_query_len == 1 and case.meta.max_seq_len == 63
            want, k_want, _ = run_torch(case)
            real = case.real_tokens
            for splits in (1, 2, 3, 7):
                got, k_got, _ = run_triton(case, num_splits=splits, block_n=16)
                assert max_err(got[:real], want[:real]) < TOL[dtype], (heads, dtype, splits)
                assert torch.equal(got[real:], torch.zeros_like(got[real:])), splits
                assert torch.equal(k_got, k_want)
                two_launches, _, _ = run_triton(case, num_splits=splits, block_n=16, fused_reduce=False)
                assert max_err(got, two_launches) <= (1e-6 if dtype == torch.float32 else 2**-7), splits
                if splits > 1:
                    assert int(arrivals._buffers[torch.device("cpu")].abs().sum()) == 0
            got, _, _ = run_triton(case)  # the backend, splits of its own choosing
            assert max_err(got[:real], want[:real]) < TOL[dtype]
    """)


def test_each_row_splits_its_own_context_whatever_the_graph_was_captured_for() -> None:
    """A decode graph passes max_model_len as max_seq_len (40,960 for Qwen3-30B-A3B). Each row still cuts
    its own context into the P splits: the same bits as with the batch's real longest context."""
    _run_interpreted("""
        case = make_case([(29, 1), (62, 1), (5, 1)], num_heads=8, num_kv_heads=2, dtype=torch.bfloat16, seed=3)
        want, _, _ = run_torch(case)
        for splits in (2, 4, 7):
            short, _, _ = run_triton(case, num_splits=splits, block_n=16)
            long, _, _ = run_triton(case, num_splits=splits, block_n=16, max_seq_len=40960)
            assert torch.equal(short, long), splits
            assert max_err(long, want) < TOL[torch.bfloat16], splits
    """)


def test_a_head_dim_below_the_dot_minimum_is_padded_and_masked() -> None:
    """tl.dot on a GPU wants operand dimensions >= 16; a head dim of 8 (the transformers-written test
    checkpoints) runs in 16-wide tiles whose padded lanes are masked: both kernels still equal torch."""
    _run_interpreted("""
        from fastdeploy_r3.model_executor.ops.paged_tiles import dot_block
        assert [dot_block(n) for n in (1, 8, 16, 17, 128)] == [16, 16, 16, 32, 128]
        for rows in ([(0, 9), (12, 5), (30, 1)], [(29, 1), (4, 1), (62, 1)]):
            case = make_case(rows, num_heads=4, num_kv_heads=2, head_dim=8, seed=5)
            want, k_want, _ = run_torch(case)
            got, k_got, _ = run_triton(case)
            assert max_err(got, want) < 2e-5 and torch.equal(k_got, k_want)
    """)


def test_short_query_rows_are_one_decode_row_per_token_over_its_causal_prefix() -> None:
    """Rows of 3, 0 (capacity padding) and 2 query tokens over contexts of 10, 0 and 5: each token becomes
    a decode row with its row's block table and the positions it may see."""
    import torch

    from fastdeploy_r3.model_executor.ops.paged_decode import short_query_rows

    tables = torch.tensor([[7, 2, 5], [0, 0, 0], [4, 1, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([10, 0, 5], dtype=torch.int32)
    start_loc = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    tok_tables, tok_seq_lens, tok_start_loc = short_query_rows(tables, seq_lens, start_loc, 5)
    assert tok_tables.tolist() == [[7, 2, 5]] * 3 + [[4, 1, 0]] * 2
    assert tok_seq_lens.tolist() == [8, 9, 10, 4, 5] and tok_seq_lens.dtype == torch.int32
    assert tok_start_loc.tolist() == [0, 1, 2, 3, 4, 5]


def test_verify_steps_at_small_batch_take_the_split_decode_kernel_one_row_per_token() -> None:
    """Verify-like rows (2..5 query tokens after contexts of 4..62, a fresh 4-token row, padded rows) at
    a batch the prefill kernel would underfill: the backend routes them through the decode kernel and
    equals the torch oracle, in float32 and bf16."""
    _run_interpreted("""
        from fastdeploy_r3.model_executor.ops.paged_decode import use_short_query_decode
        rows = [(29, 3), (4, 5), (62, 2), (0, 4)]
        for heads, kv_heads, dtype in ((4, 1, torch.float32), (8, 1, torch.bfloat16)):
            case = make_case(rows, num_heads=heads, num_kv_heads=kv_heads, dtype=dtype, padded_rows=2, seed=5)
            m = case.meta
            assert use_short_query_decode(m.seq_lens_tensor.shape[0], kv_heads, m.max_query_len, case.q.device)
            want, k_want, v_want = run_torch(case)
            got, k_got, v_got = run_triton(case)
            real = case.real_tokens
            assert max_err(got[:real], want[:real]) < TOL[dtype], (heads, dtype)
            assert torch.equal(got[real:], torch.zeros_like(got[real:]))
            assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
            # the next layer of the step reuses the per-token rows its first layer expanded
            expanded = m.derived["short_query_rows"]
            again, _, _ = run_triton(case)
            assert m.derived["short_query_rows"] is expanded and torch.equal(again, got)
    """)


def test_decode_graph_capacity_rows_beyond_the_batch_write_nothing() -> None:
    """Metadata of capacity B_max = 6 for 3 live rows: the rest have query_len 0 and seq_len 0 and must
    leave the output untouched (a CUDA graph replays the same launch for any live batch)."""
    _run_interpreted("""
        from fastdeploy_r3.model_executor.forward_context import AttentionMetadata
        from fastdeploy_r3.model_executor.layers.attention import TritonPagedAttentionBackend
        case = make_case([(10, 1), (3, 1), (21, 1)], seed=11)
        want, _, _ = run_torch(case)
        m = case.meta
        seq_lens = torch.zeros(6, dtype=torch.int32)
        seq_lens[:3] = m.seq_lens_tensor
        starts = torch.full((7,), 3, dtype=torch.int32)
        starts[:4] = m.query_start_loc_tensor
        tables = torch.zeros(6, m.block_tables.shape[1], dtype=torch.int64)
        tables[:3] = m.block_tables
        graph_meta = AttentionMetadata(m.slot_mapping, [], [], [], tables, m.block_size, seq_lens_tensor=seq_lens,
                                       query_start_loc_tensor=starts, max_query_len=1, max_seq_len=64)
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        got = TritonPagedAttentionBackend().forward(case.q, case.k, case.v, (k_cache, v_cache), graph_meta, case.scale)
        assert max_err(got, want) < 2e-5
    """)


def test_kv_write_takes_strided_views_and_skips_padded_slots() -> None:
    """k/v as views into a fused qkv row, bf16 into a float32 cache; slot -1 writes nothing."""
    _run_interpreted("""
        from fastdeploy_r3.model_executor.ops.kv_cache_write import write_kv_cache, write_kv_cache_ref
        qkv = torch.randn(5, 4 * 16 + 2 * 2 * 16).to(torch.bfloat16)  # [T, (H + 2 KVH) * D]
        k = qkv[:, 64:96].view(5, 2, 16)
        v = qkv[:, 96:].view(5, 2, 16)
        slots = torch.tensor([13, -1, 0, 22, -1])
        want = [torch.zeros(6, 4, 2, 16) for _ in range(2)]
        got = [torch.zeros(6, 4, 2, 16) for _ in range(2)]
        write_kv_cache_ref(k, v, *want, slots)
        write_kv_cache(k, v, *got, slots)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(got[0].view(-1, 2, 16)[13], k[0].float())
        assert int((got[0].abs().sum(dim=(2, 3)) > 0).sum()) == 3  # exactly three slots written
    """)


# The interpreter rounds float32 -> bf16 by truncation (triton 3.9), the GPU to nearest even as torch does:
# here bf16 results may differ by a few bf16 steps; tests/gpu bounds them to one step on the device.

def test_rms_norm_kernel_matches_the_reference_with_and_without_residual() -> None:
    """Hidden rows [T, 48] with a fused residual add, and per-head q rows [T, NH, D] read through a strided
    view: float32 within 1e-6 (the sum of squares is ordered differently), bf16 within a few bf16 steps."""
    _run_interpreted("""
        from fastdeploy_r3.model_executor.ops.rms_norm import rms_norm, rms_norm_ref
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 0.05)):
            x = torch.randn(7, 48).to(dtype)
            res = torch.randn(7, 48).to(dtype)
            w = (1 + 0.1 * torch.randn(48)).to(dtype)
            y, s = rms_norm(x, w, 1e-6, res)
            y_ref, s_ref = rms_norm_ref(x, w, 1e-6, res)
            assert s.dtype == y.dtype == dtype and s.shape == y.shape == (7, 48)
            assert max_err(s, s_ref) <= tol / 2 and max_err(y, y_ref) <= tol, dtype
            if dtype == torch.float32:
                assert torch.equal(s, s_ref)  # the residual sum is one rounding, the same as torch's
            qkv = torch.randn(7, 3 * 64).to(dtype)
            q = qkv[:, :64].view(7, 4, 16)  # strided rows
            wq = (1 + 0.1 * torch.randn(16)).to(dtype)
            got, want = rms_norm(q, wq, 1e-6), rms_norm_ref(q, wq, 1e-6)
            assert got.shape == (7, 4, 16) and max_err(got, want) <= tol, dtype
    """)


def test_rotary_kernel_rotates_in_place_full_and_partial() -> None:
    """q/k views of a fused qkv buffer rotated in place: full rotary and GLM's half rotary (the second half
    of each head untouched); bit-identical to the reference in float32, within a few bf16 steps in bf16."""
    _run_interpreted("""
        from fastdeploy_r3.model_executor.layers.rotary import RotaryEmbedding
        from fastdeploy_r3.model_executor.ops.rotary import apply_rotary_, apply_rotary_ref
        positions = torch.tensor([0, 1, 5, 77, 511, 3])
        for rotary_dim, heads in ((16, 4), (8, 4), (16, 12)):  # 12 heads: programs of 8 and of 4 (masked)
            rope = RotaryEmbedding(16, rotary_dim, 10000.0)
            cos, sin = rope.cos_sin(positions)
            assert cos.shape == (6, rotary_dim // 2) and cos.dtype == torch.float32
            qw = heads * 16
            for dtype in (torch.float32, torch.bfloat16):
                qkv = torch.randn(6, (heads + 2 * 2) * 16).to(dtype)
                q = qkv[:, :qw].view(6, heads, 16)
                k = qkv[:, qw:qw + 32].view(6, 2, 16)
                q_want, k_want = apply_rotary_ref(q, k, cos, sin)
                before = qkv.clone()
                apply_rotary_(q, k, cos, sin)
                if dtype == torch.float32:
                    assert torch.equal(q, q_want) and torch.equal(k, k_want), rotary_dim
                assert max_err(q, q_want) <= 0.05 and max_err(k, k_want) <= 0.05, (rotary_dim, dtype)
                assert torch.equal(q[..., rotary_dim:], before[:, :qw].view(6, heads, 16)[..., rotary_dim:])
                assert torch.equal(qkv[:, qw + 32:], before[:, qw + 32:])  # v untouched
    """)


def test_fused_qk_norm_and_rotary_equal_norms_then_rotary() -> None:
    """Qwen3's q_norm, k_norm and rotary in one launch, in place on views of the qkv output; with GLM's half
    rotary the pass-through channels are normalised too. Float32 within 1e-6, bf16 within a few steps."""
    _run_interpreted("""
        from fastdeploy_r3.model_executor.layers.rotary import RotaryEmbedding
        from fastdeploy_r3.model_executor.ops.rms_norm import rms_norm_ref
        from fastdeploy_r3.model_executor.ops.rotary import apply_rotary_, apply_rotary_ref
        positions = torch.tensor([0, 1, 5, 77, 511])
        for rotary_dim in (16, 8):
            cos, sin = RotaryEmbedding(16, rotary_dim, 10000.0).cos_sin(positions)
            for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 0.05)):
                qkv = torch.randn(5, (4 + 2 * 2) * 16).to(dtype)
                q, k = qkv[:, :64].view(5, 4, 16), qkv[:, 64:96].view(5, 2, 16)
                wq, wk = (1 + 0.1 * torch.randn(16)).to(dtype), (1 + 0.1 * torch.randn(16)).to(dtype)
                q_want, k_want = apply_rotary_ref(rms_norm_ref(q, wq, 1e-6), rms_norm_ref(k, wk, 1e-6), cos, sin)
                apply_rotary_(q, k, cos, sin, (wq, wk, 1e-6))
                assert max_err(q, q_want) <= 4 * tol and max_err(k, k_want) <= 4 * tol, (rotary_dim, dtype)
    """)


def test_rotary_kernel_writes_the_cache_as_the_write_kernel_would() -> None:
    """The rotary launch with a KV target: q and k rotated in place as without one, and the cache holds
    exactly what write_kv_cache would have stored from the rotated k and the untouched v (bf16 into a
    float32 cache, Qwen3's norms and GLM's half rotary); padded slot -1 writes nothing."""
    _run_interpreted("""
        from fastdeploy_r3.model_executor.layers.rotary import RotaryEmbedding
        from fastdeploy_r3.model_executor.ops.kv_cache_write import write_kv_cache
        from fastdeploy_r3.model_executor.ops.rotary import apply_rotary_
        positions = torch.tensor([0, 1, 5, 77, 9])
        slots = torch.tensor([13, -1, 0, 22, 5])
        w = (1 + 0.1 * torch.randn(16)).to(torch.bfloat16)
        for rotary_dim, norm in ((16, (w, w, 1e-6)), (8, None)):
            cos, sin = RotaryEmbedding(16, rotary_dim, 10000.0).cos_sin(positions)
            qkv = torch.randn(5, (4 + 2 * 2) * 16).to(torch.bfloat16)
            fused_qkv, split_qkv = qkv.clone(), qkv.clone()
            views = lambda t: (t[:, :64].view(5, 4, 16), t[:, 64:96].view(5, 2, 16), t[:, 96:].view(5, 2, 16))
            fused = [torch.zeros(6, 4, 2, 16) for _ in range(2)]
            split = [torch.zeros(6, 4, 2, 16) for _ in range(2)]
            q, k, v = views(fused_qkv)
            apply_rotary_(q, k, cos, sin, norm, (v, *fused, slots))
            q, k, v = views(split_qkv)
            apply_rotary_(q, k, cos, sin, norm)
            write_kv_cache(k, v, *split, slots)
            assert torch.equal(fused_qkv, split_qkv), rotary_dim  # q, k rotated the same; v untouched
            assert torch.equal(fused[0], split[0]) and torch.equal(fused[1], split[1]), rotary_dim
            assert torch.equal(fused[1].view(-1, 2, 16)[22], v[3].float())
            assert int((fused[0].abs().sum(dim=(2, 3)) > 0).sum()) == 4  # four real tokens, four slots
    """)


def test_tiny_model_through_interpreted_kernels_matches_the_torch_path(fake_model_dir) -> None:
    """The tiny Qwen3-MoE, paged: a 13-token prompt prefilled in chunks of 8 + 5, then two decode steps,
    once through the torch references and once through every Triton kernel: same logits (float32)."""
    model_dir = fake_model_dir("qwen3_moe")
    _run_interpreted(f"""
        from fastdeploy_r3.config import ModelConfig
        from fastdeploy_r3.model_executor.forward_context import AttentionMetadata, ForwardContext, set_forward_context
        from fastdeploy_r3.model_executor.layers import attention, norm, rotary
        from fastdeploy_r3.model_executor.model_loader import load_model
        model = load_model(ModelConfig({model_dir!r}, dtype="float32"), torch.device("cpu"))
        table = torch.tensor([[5, 2, 7, 0]])
        tokens = torch.randint(3, 400, (15,))

        def run():
            shape = (8, 4, model.num_kv_heads, model.head_dim)  # 8 blocks of 4
            kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
            logits = []
            for lo, hi in ((0, 8), (8, 13), (13, 14), (14, 15)):
                pos = torch.arange(lo, hi)
                meta = AttentionMetadata(table[0, pos // 4] * 4 + pos % 4, [0, hi - lo], [hi - lo], [hi], table, 4)
                with torch.no_grad(), set_forward_context(ForwardContext(meta, kv)):
                    logits.append(model.compute_logits(model(tokens[lo:hi], pos)))
            return torch.cat(logits)

        triton_logits = run()
        off = lambda x: False
        attention.use_triton = norm.use_triton = rotary.use_triton = off  # the torch references everywhere
        torch_logits = run()
        assert max_err(triton_logits, torch_logits) < 1e-4 * torch_logits.abs().max().item()
        assert torch.equal(triton_logits.argmax(-1), torch_logits.argmax(-1))
    """)
