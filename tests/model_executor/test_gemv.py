"""ops/gemv.py, the one-row 16-bit GEMV of the router gate: the kernel under TRITON_INTERPRET=1 in a
subprocess (the interpret switch is read at import), the dispatch here; the GPU side is in
tests/gpu/test_fp8_w8a8_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from triton_interpreted import run_interpreted

from fastdeploy_r3.model_executor.batch_invariant import make_batch_invariant
from fastdeploy_r3.model_executor.ops.gemv import one_row_gemv, router_gate, use_one_row_gemv


def test_one_row_times_the_weight_is_the_float32_sum_rounded_once() -> None:
    """7 outputs leave the last program's second row masked; 3000 values take two K steps, the second
    partly masked. Each output is the exact dot product rounded to bf16 (float32 sums: within one ulp)."""
    run_interpreted("""
        import torch
        import torch.nn.functional as F
        from fastdeploy_r3.model_executor.ops.gemv import one_row_gemv

        gen = torch.Generator().manual_seed(0)
        for out_cols, red_dim in ((8, 64), (7, 3000)):
            w = torch.randn(out_cols, red_dim, generator=gen).bfloat16()
            x = torch.randn(1, red_dim, generator=gen).bfloat16()
            got = one_row_gemv(x, w)
            assert got.dtype == torch.bfloat16 and got.shape == (1, out_cols), got.shape
            exact = (x.double() @ w.double().T).float()
            ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp(min=1e-3)
            assert ((got.float() - exact).abs() <= ulp).all(), (got, exact)
            assert ((F.linear(x, w).float() - exact).abs() <= ulp).all()
    """)


def test_only_a_single_16_bit_cuda_row_outside_deterministic_mode_takes_it() -> None:
    """On the CPU the router gate stays the gate module itself (what route_fused called before), and in
    deterministic mode too: there the module is the fixed-tile linear make_batch_invariant made of it.
    Bad shapes are refused with what to change."""
    w = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert not use_one_row_gemv(torch.zeros(1, 8, dtype=torch.bfloat16))
    gate = torch.nn.Linear(8, 4, bias=False)
    x = torch.randn(3, 8)
    assert torch.equal(router_gate(x, gate), F.linear(x, gate.weight))
    make_batch_invariant(gate)
    calls = []
    gate.register_forward_hook(lambda module, args, out: calls.append(type(module).__name__))
    router_gate(x[:1], gate, batch_invariant=True)
    assert calls == ["RowTiledLinear"]
    with pytest.raises(ValueError, match="one contiguous row of 8"):
        one_row_gemv(torch.zeros(2, 8, dtype=torch.bfloat16), w)
