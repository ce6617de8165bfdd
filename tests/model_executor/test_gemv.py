"""ops/gemv.py, the 16-bit GEMV of the router gate at one to eight rows: the kernel under TRITON_INTERPRET=1 in a
subprocess (the interpret switch is read at import), the dispatch here; the GPU side is in
tests/gpu/test_fp8_w8a8_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from triton_interpreted import run_interpreted

from fastdeploy_r3.model_executor.batch_invariant import make_batch_invariant
from fastdeploy_r3.model_executor.ops.gemv import one_row_gemv, router_gate, use_one_row_gemv


def test_rows_times_the_weight_are_the_float32_sums_rounded_once_each_row_as_alone() -> None:
    """7 outputs leave the last program's second row masked; 3000 values take two K steps, the second
    partly masked. Each output is the exact dot product rounded to bf16 (float32 sums: within one ulp).
    Three rows (a verify step's k + 1 = 3, padded to four in the kernel) read the weight once and give
    each row the bits it gets alone; nine rows are refused."""
    run_interpreted("""
        import pytest
        import torch
        import torch.nn.functional as F
        from fastdeploy_r3.model_executor.ops.gemv import one_row_gemv

        gen = torch.Generator().manual_seed(0)
        for out_cols, red_dim in ((8, 64), (7, 3000)):
            w = torch.randn(out_cols, red_dim, generator=gen).bfloat16()
            x = torch.randn(3, red_dim, generator=gen).bfloat16()
            alone = [one_row_gemv(x[i : i + 1], w) for i in range(3)]
            assert alone[0].dtype == torch.bfloat16 and alone[0].shape == (1, out_cols), alone[0].shape
            exact = (x.double() @ w.double().T).float()
            ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp(min=1e-3)
            got = one_row_gemv(x, w)
            assert got.shape == (3, out_cols) and torch.equal(got, torch.cat(alone))
            assert ((got.float() - exact).abs() <= ulp).all(), (got, exact)
            assert ((F.linear(x, w).float() - exact).abs() <= ulp).all()
        with pytest.raises(ValueError, match="1 to 8 rows of 64"):
            one_row_gemv(torch.zeros(9, 64).bfloat16(), torch.zeros(4, 64).bfloat16())
    """)


def test_only_few_16_bit_cuda_rows_outside_deterministic_mode_take_it() -> None:
    """On the CPU the router gate stays the gate module itself (what route_fused called before), and in
    deterministic mode too: there the module is the fixed-tile linear make_batch_invariant made of it.
    Bad shapes are refused with what to change."""
    w = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert not use_one_row_gemv(torch.zeros(1, 8, dtype=torch.bfloat16))  # the CPU
    if torch.cuda.is_available():
        rows = torch.zeros(4, 8, dtype=torch.bfloat16, device="cuda")
        assert use_one_row_gemv(rows, max_rows=4) and not use_one_row_gemv(rows, max_rows=3)
        assert not use_one_row_gemv(rows, batch_invariant=True, max_rows=4)
    gate = torch.nn.Linear(8, 4, bias=False)
    x = torch.randn(3, 8)
    assert torch.equal(router_gate(x, gate), F.linear(x, gate.weight))
    make_batch_invariant(gate)
    calls = []
    gate.register_forward_hook(lambda module, args, out: calls.append(type(module).__name__))
    router_gate(x[:1], gate, batch_invariant=True)
    assert calls == ["RowTiledLinear"]
    with pytest.raises(ValueError, match="1 to 8 rows of 8 contiguous values"):
        one_row_gemv(torch.zeros(2, 7, dtype=torch.bfloat16), w)


def test_the_gate_gemv_with_the_norm_before_it_gives_the_norm_kernels_row_and_the_gemv_of_it() -> None:
    """normed_gemv: a batch-1 step's post-attention RMSNorm (with its residual add) inside the router gate's
    GEMV. On a row of 3000 (two K steps, a partial norm block) it returns the Triton norm kernel's normed
    row and sum, and the logits the GEMV gives that row, bit for bit; on a verify step's 3 rows each row's
    logits, normed row and sum are the ones it gets alone; 9 rows are refused."""
    run_interpreted("""
        import pytest
        import torch
        from fastdeploy_r3.model_executor.ops.gemv import normed_gemv, one_row_gemv
        from fastdeploy_r3.model_executor.ops.rms_norm import rms_norm

        gen = torch.Generator().manual_seed(3)
        for red_dim in (64, 3000):
            w = torch.randn(7, red_dim, generator=gen).bfloat16()
            x, residual = (torch.randn(1, red_dim, generator=gen).bfloat16() * 3 for _ in range(2))
            norm_weight = (torch.rand(red_dim, generator=gen) + 0.5).bfloat16()
            h, total = rms_norm(x, norm_weight, 1e-6, residual)
            logits, got_h, got_total = normed_gemv(x, residual, norm_weight, 1e-6, w)
            assert torch.equal(got_total, total) and torch.equal(got_h, h), red_dim
            assert torch.equal(logits, one_row_gemv(h, w)), red_dim
        xs, residuals = (torch.randn(3, red_dim, generator=gen).bfloat16() * s for s in (3, 1))
        logits, got_h, got_total = normed_gemv(xs, residuals, norm_weight, 1e-6, w)
        assert logits.shape == (3, 7) and got_h.shape == got_total.shape == (3, red_dim)
        for r in range(3):
            alone = normed_gemv(xs[r : r + 1], residuals[r : r + 1], norm_weight, 1e-6, w)
            assert all(torch.equal(a[r], b[0]) for a, b in zip((logits, got_h, got_total), alone)), r
        with pytest.raises(ValueError, match="must be 1 to 8 rows of 3000"):
            normed_gemv(torch.zeros(9, 3000).bfloat16(), torch.zeros(9, 3000).bfloat16(), norm_weight, 1e-6, w)
    """)
