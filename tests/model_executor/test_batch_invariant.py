"""The batch-invariant ops (model_executor/batch_invariant.py): a row's bits never depend on the other rows
of the call, and a query's attention output never depends on how the queries were chunked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from batch_invariance_cases import attention_scenarios
from triton_interpreted import run_interpreted

from fastdeploy_r3.model_executor.batch_invariant import (
    BatchInvariantAttentionBackend,
    RowTiledLinear,
    invariant_attention,
    invariant_linear,
    invariant_rows,
    make_batch_invariant,
)
from fastdeploy_r3.model_executor.layers.attention import Attention, TorchPagedAttentionBackend, _causal_attention
from fastdeploy_r3.model_executor.layers.moe import loop_experts

ROW_COUNTS = (1, 2, 7, 16, 17, 33, 64)


def _first_row(fn, x: torch.Tensor, w: torch.Tensor) -> dict[int, torch.Tensor]:  # noqa: ANN001
    return {n: fn(x[:n], w)[0] for n in ROW_COUNTS}


def test_float32_linear_is_not_batch_invariant_on_this_cpu() -> None:
    """The fact the mode exists for: the same first row, multiplied in calls of 1..64 rows, comes back
    with other bits for some row counts (the BLAS picks its kernel by shape)."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 256), torch.randn(512, 256)
    rows = _first_row(F.linear, x, w)
    assert any(not torch.equal(rows[1], r) for r in rows.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_linear_gives_a_row_the_same_bits_in_any_call(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, w, b = torch.randn(64, 1024, dtype=dtype), torch.randn(256, 1024, dtype=dtype), torch.randn(256, dtype=dtype)
    rows = _first_row(lambda x_, w_: invariant_linear(x_, w_, b), x, w)
    for n, r in rows.items():
        assert torch.equal(r, rows[1]), f"row 0 differs in a call of {n} rows"
    # any row, anywhere in its tile, whatever the others hold
    shuffled = torch.randperm(64)
    assert torch.equal(invariant_linear(x[shuffled], w, b), invariant_linear(x, w, b)[shuffled])
    torch.testing.assert_close(invariant_linear(x, w, b), F.linear(x, w, b))
    assert invariant_linear(x[:0], w).shape == (0, 256)
    assert invariant_linear(x[:10].view(2, 5, 1024), w).shape == (2, 5, 256)


def test_cpu_sigmoid_is_not_batch_invariant_and_invariant_rows_is() -> None:
    """A vectorized CPU loop ends in a scalar tail placed by the tensor's size: the sigmoid of a token's row
    comes back with other bits when that row is the last of an odd-sized call; in fixed row tiles never.
    Rows of 13: whatever the vector width (AVX2's 8 floats, AVX-512's 16), n * 13 leaves a tail for most n
    (rows of 16 leave none on an AVX2 machine, where the premise then never shows)."""
    torch.manual_seed(0)
    x = torch.randn(64, 13)
    whole = torch.sigmoid(x)
    assert any(not torch.equal(torch.sigmoid(x[:n])[n - 1], whole[n - 1]) for n in range(1, 65))
    tiled = invariant_rows(torch.sigmoid, x, batch_invariant=True)
    assert all(torch.equal(invariant_rows(torch.sigmoid, x[:n], batch_invariant=True), tiled[:n]) for n in range(1, 65))
    torch.testing.assert_close(tiled, whole)
    gate = torch.randn(9, 64)[:, :32]  # a strided view, as chunk() hands loop_experts
    silu = invariant_rows(F.silu, gate, True)
    assert all(torch.equal(invariant_rows(F.silu, gate[:n], True), silu[:n]) for n in range(1, 10))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_is_the_same_whole_chunked_or_one_query_at_a_time(dtype: torch.dtype) -> None:
    """A 37-position sequence (3 KV tiles, the last one partial): prefill at once, in chunks as a chunked
    prefill or a prefix-cache hit computes it, and one query at a time as decode does."""
    torch.manual_seed(0)
    seq, heads, kv_heads, dim = 37, 4, 2, 16
    q, k, v = torch.randn(seq, heads, dim, dtype=dtype), *torch.randn(2, seq, kv_heads, dim, dtype=dtype)
    whole = invariant_attention(q, k, v, 0.25)  # [S, H, D]
    chunks = [invariant_attention(q[a:b], k[:b], v[:b], 0.25) for a, b in ((0, 5), (5, 21), (21, 37))]
    assert torch.equal(torch.cat(chunks), whole)
    for p in (0, 15, 16, 36):
        assert torch.equal(invariant_attention(q[p : p + 1], k[: p + 1], v[: p + 1], 0.25)[0], whole[p])
    torch.testing.assert_close(whole.float(), _causal_attention(q.float(), k.float(), v.float(), 0.25),
                               **({} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_of_a_request_is_the_same_alone_chunked_among_others_and_decoded(dtype: torch.dtype) -> None:
    """tests/batch_invariance_cases.py's three ways of computing one request, through the engine's paged
    backend. The default torch backend gives the float32 chunks other bits (its einsums' shapes change)."""
    got = attention_scenarios(BatchInvariantAttentionBackend(), dtype, "cpu")
    assert all(torch.equal(out, got["alone"]) for out in got.values())
    default = attention_scenarios(TorchPagedAttentionBackend(), dtype, "cpu")
    torch.testing.assert_close(got["alone"], default["alone"],
                               **({} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}))  # fmt: skip
    if dtype == torch.float32:
        assert not torch.equal(default["chunked"], default["alone"])


def _run_interpreted(body: str) -> None:
    """body in a fresh process with TRITON_INTERPRET=1 (set before triton builds a kernel)."""
    pytest.importorskip("triton")
    run_interpreted(body, """
import torch
from fastdeploy_r3.model_executor.ops import triton_setup
assert triton_setup.INTERPRET  # really the interpreted kernels
""")


def test_triton_attention_path_is_the_same_alone_chunked_among_others_and_decoded() -> None:
    """The same scenarios through the Triton prefill kernel with its fixed tiles (what CUDA runs), under the
    interpreter (bf16; tests/gpu/test_deterministic_gpu.py runs them on the GPU)."""
    _run_interpreted("""
        from batch_invariance_cases import attention_scenarios
        from fastdeploy_r3.model_executor.batch_invariant import BatchInvariantAttentionBackend
        from fastdeploy_r3.model_executor.layers.attention import TorchPagedAttentionBackend
        got = attention_scenarios(BatchInvariantAttentionBackend(), torch.bfloat16, "cpu")
        assert all(torch.equal(out, got["alone"]) for out in got.values())
        triton_setup.INTERPRET = False  # not a kernel: the torch reference
        want = attention_scenarios(TorchPagedAttentionBackend(), torch.bfloat16, "cpu")["alone"]
        assert (want.float() - got["alone"].float()).abs().max().item() < 2e-2
    """)


def test_triton_invariant_matmul_gives_a_row_the_same_bits_in_any_call() -> None:
    """ops/invariant_matmul.py under the interpreter: 70 x 96 @ (80 x 96)^T, partial tiles on every side;
    the first M rows alone equal the same rows of the whole call; equal to F.linear within rounding;
    invariant_linear takes it where Triton runs."""
    _run_interpreted("""
        import torch.nn.functional as F
        from fastdeploy_r3.model_executor.batch_invariant import invariant_linear
        from fastdeploy_r3.model_executor.ops.invariant_matmul import MatmulConfig, invariant_matmul
        torch.manual_seed(0)
        # K = 96 in three fixed ranges of 32, summed by the second launch
        split = MatmulConfig(block_k=32, split_k=3)
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
            x, w, b = torch.randn(70, 96).to(dtype), torch.randn(80, 96).to(dtype), torch.randn(80).to(dtype)
            whole = invariant_matmul(x, w, b)
            whole_split = invariant_matmul(x, w, b, config=split)
            for m in (1, 5, 64, 65):
                assert torch.equal(invariant_matmul(x[:m], w, b), whole[:m]), (dtype, m)
                assert torch.equal(invariant_matmul(x[:m], w, b, config=split), whole_split[:m]), (dtype, m)
            assert (whole_split.float() - whole.float()).abs().max().item() < tol * 10
            # rows 64.. start a tile in both calls: the interpreter's dot is numpy's matmul, and with an
            # AVX-512 BLAS a row's bits can depend on its place inside the tile (on the GPU a request's rows
            # land anywhere in a tile: tests/gpu/test_deterministic_gpu.py's engine test)
            assert torch.equal(invariant_linear(x[64:70], w, b), whole[64:70])
            assert (whole.float() - F.linear(x.float(), w.float(), b.float())).abs().max().item() < tol * 10
            assert invariant_matmul(x[:0], w).shape == (0, 80)
            assert invariant_matmul(x[:6].view(2, 3, 96), w).shape == (2, 3, 80)
    """)


def test_the_slot_sum_kernel_adds_the_k_experts_in_slot_order_as_a_loop_would() -> None:
    """The batch-invariant fused MoE's last launch: part [T, K, H] float32 summed over K in slot order, bit
    for bit what a Python loop of adds gives (H not a multiple of the block), then cast once. (The
    interpreter casts float32 to bf16 by truncation where the GPU rounds to nearest: bf16 within one ulp.)"""
    _run_interpreted("""
        from fastdeploy_r3.model_executor.ops.fused_moe_triton import _sum_slots_kernel
        torch.manual_seed(0)
        part = torch.randn(5, 8, 1500) * 1e3
        for dtype in (torch.bfloat16, torch.float32):
            want = part[:, 0]
            for k in range(1, 8):
                want = want + part[:, k]
            out = torch.empty(5, 1500, dtype=dtype)
            _sum_slots_kernel[(8,)](part, out, 5, 1500, TOP_K=8, BLOCK=1024)
            if dtype == torch.float32:
                assert torch.equal(out, want)
            else:
                assert ((out.float() - want).abs() <= want.abs() * 2**-7).all()
    """)


def test_triton_experts_in_batch_invariant_mode_give_a_token_the_same_bits_in_any_batch() -> None:
    """The fused MoE under the interpreter, one tile config: token 0 (experts 1 and 3) alone, and among 40
    tokens (the default configs would switch tiles at that many rows per expert)."""
    _run_interpreted("""
        from fastdeploy_r3.model_executor.layers.moe import loop_experts
        from fastdeploy_r3.model_executor.ops.fused_moe_triton import triton_experts
        torch.manual_seed(0)
        experts, hidden, inter = 4, 64, 32
        # float32: this kernel's bf16 dot is not upcast under the interpreter (triton_setup.mma says why)
        w13, w2 = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
        x = torch.randn(41, hidden)
        ids = torch.randint(0, experts, (41, 2))
        ids[0] = torch.tensor([1, 3])
        weights = torch.rand(41, 2)
        alone = triton_experts(x[:1], w13, w2, weights[:1], ids[:1], batch_invariant=True)
        batch = triton_experts(x, w13, w2, weights, ids, batch_invariant=True)
        assert torch.equal(batch[0], alone[0])
        want = loop_experts(x, w13, w2, weights, ids)
        assert (batch - want).abs().max().item() < 1e-5 * want.abs().max().item()
    """)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loop_experts_rows_do_not_depend_on_the_experts_other_rows(dtype: torch.dtype) -> None:
    """Token 0 routed to experts 1 and 3, alone and among 40 tokens that also hit them."""
    torch.manual_seed(0)
    experts, hidden, inter = 4, 64, 32
    w13, w2 = torch.randn(experts, 2 * inter, hidden, dtype=dtype), torch.randn(experts, hidden, inter, dtype=dtype)
    x = torch.randn(41, hidden, dtype=dtype)
    ids = torch.randint(0, experts, (41, 2))
    ids[0] = torch.tensor([1, 3])
    weights = torch.rand(41, 2)
    alone = loop_experts(x[:1], w13, w2, weights[:1], ids[:1], batch_invariant=True)
    batch = loop_experts(x, w13, w2, weights, ids, batch_invariant=True)
    assert torch.equal(batch[0], alone[0])
    torch.testing.assert_close(batch, loop_experts(x, w13, w2, weights, ids),
                               **({} if dtype == torch.float32 else {"atol": 1e-1, "rtol": 2e-2}))  # fmt: skip


def test_make_batch_invariant_switches_every_gemm_and_attention(fake_model_dir) -> None:  # noqa: ANN001
    from fastdeploy_r3.config import ModelConfig
    from fastdeploy_r3.model_executor.layers.linear import ShardedLinear
    from fastdeploy_r3.model_executor.layers.mlp import GatedMLP
    from fastdeploy_r3.model_executor.layers.moe import SparseMoeBlock, StackedExperts
    from fastdeploy_r3.model_executor.layers.qkv_linear import QKVParallelLinear
    from fastdeploy_r3.model_executor.model_loader import load_model

    model = load_model(ModelConfig(fake_model_dir("glm4_moe"), enable_deterministic_inference=True),
                       torch.device("cpu"))  # fmt: skip
    kinds = (ShardedLinear, QKVParallelLinear, StackedExperts, SparseMoeBlock, GatedMLP)
    layers = [m for m in model.modules() if isinstance(m, kinds)]
    assert layers and all(m.batch_invariant for m in layers)
    assert model.model.layers[0].self_attn.rotary.batch_invariant
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, RowTiledLinear)
    assert all(isinstance(m.backend, BatchInvariantAttentionBackend) for m in model.modules()
               if isinstance(m, Attention))  # fmt: skip
    # parameters and buffers are the loaded ones, under their names
    gate = model.model.layers[1].mlp.gate
    assert isinstance(gate, RowTiledLinear) and "e_score_correction_bias" in dict(gate.named_buffers())
    assert make_batch_invariant(model) is model
    from fastdeploy_r3.worker.cuda_graph_runner import attention_is_graph_safe

    assert attention_is_graph_safe(model)  # on CUDA decode steps still capture into graphs


def test_deterministic_kv_never_mixes_with_the_default_kernels_kv(fake_model_dir) -> None:  # noqa: ANN001
    """The prefix-cache hash chain and the storage tier's namespace are seeded by model_identity."""
    from fastdeploy_r3.config import ModelConfig

    default = ModelConfig(fake_model_dir("qwen3_moe"))
    deterministic = ModelConfig(fake_model_dir("qwen3_moe"), enable_deterministic_inference=True)
    assert deterministic.model_identity == default.model_identity + ":deterministic"
