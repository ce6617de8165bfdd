"""The fused MoE kernel on block-quantized fp8 experts (ops/fused_moe_triton.py, FP8_W) dequantises each
weight tile as it loads it, with quantization/fp8.py dequantize()'s arithmetic: its output equals the
same kernel on the dequantised weights exactly (float32 activations under TRITON_INTERPRET=1, where the
interpreter's bf16 rounding is not the GPU's, so bf16 is held to the loop within its precision here and
by tests/gpu/test_fp8_gpu.py on the H200, where the two differ in the MMA's summation order only). The
dense linear (ops/fp8_linear.py) runs the same kernel as one expert. The shapes leave partial 128-wide
scale blocks on both dimensions, as tiny checkpoints do."""

from __future__ import annotations

import pytest
import torch
from triton_interpreted import run_interpreted

from fastdeploy_r3.model_executor.ops.fused_moe_triton import TritonMoeConfig, triton_experts

# imported once by the file's interpreter process (tests/triton_interpreted.py), before each body
PRELUDE = """
import torch
from fastdeploy_r3.model_executor.ops import fp8_gemv, fp8_linear, fused_moe_triton
from fastdeploy_r3.model_executor.quantization import fp8

def stack_experts(w):  # [E, O, I] -> (fp8 codes, served scale rows [E, O, ceil(I/128)])
    pairs = [fp8.quantize_blockwise(m) for m in w]
    return torch.stack([c for c, _ in pairs]), torch.stack([fp8.expand_scale_rows(s, w.shape[1]) for _, s in pairs])
"""


def test_fp8_tiles_dequantised_in_the_kernel_equal_the_kernel_on_dequantised_weights() -> None:
    run_interpreted("""
        import torch
        from fastdeploy_r3.model_executor.layers.moe import loop_experts
        from fastdeploy_r3.model_executor.ops.fused_moe_triton import TritonMoeConfig, triton_experts
        from fastdeploy_r3.model_executor.quantization.fp8 import dequantize, expand_scale_rows, quantize_blockwise

        def quantize_stack(w):  # [E, O, I] -> fp8 codes and served scale rows [E, O, ceil(I/128)]
            pairs = [quantize_blockwise(m) for m in w]
            codes = torch.stack([c for c, _ in pairs])
            rows = torch.stack([expand_scale_rows(s, w.shape[1]) for _, s in pairs])
            return codes, rows

        torch.manual_seed(0)
        for T, E, K, H, I in ((5, 4, 2, 200, 136),):  # partial scale blocks on both dimensions
            x = torch.randn(T, H)
            w13, w2 = quantize_stack(torch.randn(E, 2 * I, H) * 0.1), quantize_stack(torch.randn(E, H, I) * 0.1)
            ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
            w = torch.rand(T, K)
            plain13, plain2 = dequantize(*w13, torch.float32), dequantize(*w2, torch.float32)
            for cfg in (TritonMoeConfig(16, 32, 64, 4, 1),):  # K tiles 0, 64 | 128, 192: scale columns 0, 0 | 1, 1
                want = triton_experts(x, plain13, plain2, w, ids, cfg)
                got = triton_experts(x, w13[0], w2[0], w, ids, cfg, w13_scale=w13[1], w2_scale=w2[1])
                assert torch.equal(got, want), (T, cfg, (got - want).abs().max().item())
            # bf16 activations: the interpreter rounds float32 -> bf16 its own way (not the GPU's
            # round-to-nearest; 2.2e-2 off the bf16 loop here), so this only holds the kernel to the loop
            # within that: what it catches is a bf16 dot read as raw bits (1e11 off, before UPCAST)
            xb = x.bfloat16()
            ref = loop_experts(xb, plain13.bfloat16(), plain2.bfloat16(), w, ids).float()
            got = triton_experts(xb, w13[0], w2[0], w, ids, TritonMoeConfig(16, 32, 64, 4, 1),
                                 w13_scale=w13[1], w2_scale=w2[1]).float()
            assert ((got - ref).norm() / ref.norm()).item() < 5e-2, ((got - ref).norm() / ref.norm()).item()
    """, PRELUDE)


def test_the_fp8_dense_linear_equals_a_matmul_on_the_dequantised_weight() -> None:
    """y = x @ dequantize(W)^T for 1, 5, 20 and 70 rows (each tile shape of ops/fp8_linear._tiles), W 200 x 136
    (partial scale blocks), in float32: equal to torch's matmul within float32 summation order, and the
    padded rows of the last tile write nothing (the output is exactly [M, O])."""
    run_interpreted("""
        import torch
        from fastdeploy_r3.model_executor.ops.fp8_linear import fp8_linear
        from fastdeploy_r3.model_executor.quantization.fp8 import dequantize, expand_scale_rows, quantize_blockwise

        torch.manual_seed(0)
        codes, scale = quantize_blockwise(torch.randn(200, 136) * 0.1)
        rows = expand_scale_rows(scale, 200)
        w = dequantize(codes, rows, torch.float32)
        for m in (1, 5, 20, 70):
            x = torch.randn(m, 136)
            got, want = fp8_linear(x, codes, rows), x @ w.T
            assert got.shape == (m, 200) and got.dtype == torch.float32
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (m, (got - want).abs().max().item())
            strided = torch.randn(m, 272)[:, ::2]  # a non-contiguous x is copied, not misread
            assert torch.allclose(fp8_linear(strided, codes, rows), strided @ w.T, rtol=1e-5, atol=1e-5)
    """, PRELUDE)


def test_fp8_weights_need_both_scales_and_whole_k_tiles_of_a_scale_block() -> None:
    x, w = torch.zeros(1, 8), torch.zeros(2, 8, 8)
    ids, weights = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    with pytest.raises(ValueError, match="both scales"):
        triton_experts(x, w, w, weights, ids, TritonMoeConfig(16, 16, 64, 4, 1), w13_scale=torch.ones(2, 8, 1))
    with pytest.raises(ValueError, match="block_k dividing 128"):
        triton_experts(x, w, w, weights, ids, TritonMoeConfig(16, 16, 96, 4, 1), w13_scale=torch.ones(2, 8, 1),
                       w2_scale=torch.ones(2, 8, 1))  # fmt: skip


def test_w8a8_quantizes_activations_like_torch_and_equals_the_float32_product_of_the_dequantised_operands() -> None:
    """W8A8 (FP8_A): x is cut into 128-wide groups per row, each scaled by amax / 448 to e4m3 codes, exactly
    as quantize_groups_reference does it in torch (an all-zero group gets the floor scale); the dense linear
    and the fused MoE (x, then the intermediate, quantized) equal float32 torch on the dequantised operands
    within float32 summation order. The CUDA side: tests/gpu/test_fp8_w8a8_gpu.py."""
    run_interpreted("""
        import torch
        import torch.nn.functional as F
        from fastdeploy_r3.model_executor.ops.fp8_linear import fp8_linear
        from fastdeploy_r3.model_executor.ops.fp8_quant import quantize_groups, quantize_groups_reference
        from fastdeploy_r3.model_executor.ops.fused_moe_triton import TritonMoeConfig, pick_fp8_config, triton_experts
        from fastdeploy_r3.model_executor.quantization.fp8 import dequantize, expand_scale_rows, quantize_blockwise

        torch.manual_seed(0)
        x = torch.randn(5, 200) * 3
        x[1, 128:] = 0
        codes, scales = quantize_groups(x)
        want_codes, want_scales = quantize_groups_reference(x)
        assert torch.equal(scales, want_scales) and 0 < scales[1, 1].item() < 1e-12
        assert not codes[1, 128:].float().any()  # the zero group: zero codes under the floor scale
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))

        w_codes, w_scale = quantize_blockwise(torch.randn(300, 200) * 0.1)
        rows = expand_scale_rows(w_scale, 300)
        w = dequantize(w_codes, rows, torch.float32)
        for m in (1, 20):
            x = torch.randn(m, 200)
            got = fp8_linear(x, w_codes, rows, fp8_activations=True)
            want = dequantize(*quantize_groups_reference(x), torch.float32) @ w.T
            assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item() * 10, m

        T, E, K, H, I = 5, 4, 2, 256, 136
        x = torch.randn(T, H)
        w13, w2 = stack_experts(torch.randn(E, 2 * I, H) * 0.1), stack_experts(torch.randn(E, H, I) * 0.1)
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
        weights = torch.rand(T, K)
        got = triton_experts(x, w13[0], w2[0], weights, ids, TritonMoeConfig(16, 32, 128, 4, 1),
                             w13_scale=w13[1], w2_scale=w2[1], fp8_activations=True)
        p13, p2 = dequantize(*w13, torch.float32), dequantize(*w2, torch.float32)
        xd = dequantize(*quantize_groups_reference(x), torch.float32)
        want = torch.zeros(T, H)
        for t in range(T):
            for j in range(K):
                g = xd[t] @ p13[ids[t, j]].T
                act = F.silu(g[:I]) * g[I:]
                act_d = dequantize(*quantize_groups_reference(act[None]), torch.float32)[0]
                want[t] += weights[t, j] * (act_d @ p2[ids[t, j]].T)
        assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item(), (got - want).abs().max().item()
        # auto (16-bit activations): W8A8 at every batch, in blocks of pick_config's block_m
        assert pick_fp8_config(1, 8, 128).block_k == 128 and pick_fp8_config(4096, 8, 128).block_m == 64
    """, PRELUDE)


def test_one_row_gemv_is_the_w8a8_tile_kernels_arithmetic_and_skips_foreign_experts() -> None:
    """ops/fp8_gemv.py, a batch-1 decode row: its in-kernel rounding to e4m3 is torch's cast (every binade,
    subnormals, ties to even); the dense GEMV and the fused MoE of one token equal the W8A8 tile kernels on
    the same row within float32 summation order (same codes, same scales, same rounding points), for every
    tile shape; a slot whose expert is not on this rank (id E) adds nothing."""
    run_interpreted("""
        import torch
        import torch.nn.functional as F
        from fastdeploy_r3.model_executor.ops.fp8_gemv import DOWN, GATED, fp8_gemv_experts, fp8_gemv_linear
        from fastdeploy_r3.model_executor.ops.fp8_linear import fp8_linear
        from fastdeploy_r3.model_executor.ops.fp8_quant import e4m3_values, quantize_groups_reference
        from fastdeploy_r3.model_executor.ops.fused_moe_triton import TritonMoeConfig, triton_experts
        from fastdeploy_r3.model_executor.quantization.fp8 import dequantize, expand_scale_rows, quantize_blockwise

        torch.manual_seed(0)
        every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        every = every[every.isfinite()].sort().values  # all 253 distinct finite values (+-0 twice)
        mids = (every[1:] + every[:-1]) / 2  # exact ties: to the even neighbour
        q = torch.cat([every, mids, torch.randn(20000) * 4, torch.randn(20000) * 300, torch.rand(5000) * 0.02,
                       torch.tensor([500.0, -1000.0])])
        assert torch.equal(e4m3_values(q), q.clamp(-448, 448).to(torch.float8_e4m3fn).float())
        codes, scale = quantize_blockwise(torch.randn(300, 200) * 0.1)  # partial 128-blocks both ways
        rows = expand_scale_rows(scale, 300)
        x = torch.randn(1, 200)
        tile = fp8_linear(x, codes, rows, fp8_activations=True)
        for tiles in (None, (16, 128, 4), (32, 256, 2)):
            got = fp8_gemv_linear(x, codes, rows, tiles)
            assert got.shape == (1, 300) and (got - tile).abs().max() <= 1e-6 * tile.abs().max(), tiles

        E, K, H, I = 4, 2, 256, 136
        w13, w2 = stack_experts(torch.randn(E, 2 * I, H) * 0.1), stack_experts(torch.randn(E, H, I) * 0.1)
        x = torch.randn(1, H)
        weights = torch.rand(1, K)
        tile = triton_experts(x, w13[0], w2[0], weights, torch.tensor([[2, 0]]), TritonMoeConfig(16, 32, 128, 4, 1),
                              w13_scale=w13[1], w2_scale=w2[1], fp8_activations=True)
        for tiles in (None, {GATED: (16, 128, 4), DOWN: (8, 256, 2)}):
            got = fp8_gemv_experts(x, w13[0], w13[1], w2[0], w2[1], weights, torch.tensor([[2, 0]]), tiles)
            assert (got - tile).abs().max() <= 1e-6 * tile.abs().max(), tiles
        import fastdeploy_r3.model_executor.ops.fp8_gemv as gemv  # no arrival counters: the separate slot sum
        fused = fp8_gemv_experts(x, w13[0], w13[1], w2[0], w2[1], weights, torch.tensor([[2, 0]]))
        counters, gemv.arrival_counters = gemv.arrival_counters, lambda device, n: None
        assert torch.equal(fp8_gemv_experts(x, w13[0], w13[1], w2[0], w2[1], weights, torch.tensor([[2, 0]])), fused)
        gemv.arrival_counters = counters
        # expert 3 here, the other slot's expert on another rank: only expert 3's weighted output
        got = fp8_gemv_experts(x, w13[0], w13[1], w2[0], w2[1], weights, torch.tensor([[3, E]]))
        p13, p2 = dequantize(*w13, torch.float32), dequantize(*w2, torch.float32)
        g = dequantize(*quantize_groups_reference(x), torch.float32)[0] @ p13[3].T
        act = dequantize(*quantize_groups_reference((F.silu(g[:I]) * g[I:])[None]), torch.float32)[0]
        want = weights[0, 0] * (act @ p2[3].T)
        assert (got[0] - want).abs().max() <= 1e-5 * want.abs().max()
    """, PRELUDE)


def test_few_token_gemv_moe_gives_each_token_its_one_token_bits() -> None:
    """fp8_gemv_experts on 3 tokens (a verify step's rows): tokens 0 and 1 share expert 0, token 1's other
    expert is on another rank. Each token's row is, bit for bit, the one that token gets launched alone
    (its programs' sums never see the other tokens), with the arrival counters and with the separate slot
    sum; and the 3 rows equal the W8A8 tile kernel's to float32 summation order."""
    run_interpreted("""
        import torch
        import fastdeploy_r3.model_executor.ops.fp8_gemv as gemv
        from fastdeploy_r3.model_executor.ops.fp8_gemv import fp8_gemv_experts
        from fastdeploy_r3.model_executor.ops.fused_moe_triton import TritonMoeConfig, triton_experts

        torch.manual_seed(3)
        E, K, H, I = 4, 2, 256, 136
        w13, w2 = stack_experts(torch.randn(E, 2 * I, H) * 0.1), stack_experts(torch.randn(E, H, I) * 0.1)
        x = torch.randn(3, H)
        weights = torch.rand(3, K)
        ids = torch.tensor([[2, 0], [0, E], [1, 3]])
        moe = lambda x, weights, ids: fp8_gemv_experts(x, w13[0], w13[1], w2[0], w2[1], weights, ids)
        got = moe(x, weights, ids)
        assert got.shape == (3, H)
        for t in range(3):
            assert torch.equal(got[t], moe(x[t : t + 1], weights[t : t + 1], ids[t : t + 1])[0]), t
        counters, gemv.arrival_counters = gemv.arrival_counters, lambda device, n: None
        assert torch.equal(moe(x, weights, ids), got)
        gemv.arrival_counters = counters
        local = torch.tensor([[2, 0], [0, 1], [1, 3]])
        tile = triton_experts(x, w13[0], w2[0], weights, local, TritonMoeConfig(16, 32, 128, 4, 1),
                              w13_scale=w13[1], w2_scale=w2[1], fp8_activations=True)
        mine = moe(x, weights, local)
        assert (mine - tile).abs().max() <= 1e-6 * tile.abs().max()
    """, PRELUDE)


def test_one_row_gemv_with_the_norm_before_it_fused_equals_the_norm_kernel_then_the_gemv() -> None:
    """fp8_gemv_normed_linear: a decoder layer's input RMSNorm (with its residual add) inside the qkv GEMV
    of a batch-1 step. On a row of 200 (a partial scale group, a partial norm block) it gives the Triton
    norm kernel's output fed to the GEMV bit for bit, in bf16 and float32, and returns the norm's sum."""
    run_interpreted("""
        import torch
        from fastdeploy_r3.model_executor.ops.fp8_gemv import fp8_gemv_linear, fp8_gemv_normed_linear
        from fastdeploy_r3.model_executor.ops.rms_norm import rms_norm
        from fastdeploy_r3.model_executor.quantization.fp8 import expand_scale_rows, quantize_blockwise

        torch.manual_seed(1)
        codes, scale = quantize_blockwise(torch.randn(300, 200) * 0.1)
        rows = expand_scale_rows(scale, 300)
        for dtype in (torch.bfloat16, torch.float32):
            x, residual = torch.randn(1, 200, dtype=dtype), torch.randn(1, 200, dtype=dtype) * 3
            norm_weight = (torch.rand(200) + 0.5).to(dtype)
            h, total = rms_norm(x, norm_weight, 1e-6, residual)
            want = fp8_gemv_linear(h, codes, rows)
            for tiles in (None, (16, 128, 4)):
                got, got_total = fp8_gemv_normed_linear(x, residual, norm_weight, 1e-6, codes, rows, tiles)
                assert torch.equal(got_total, total), dtype
                assert torch.equal(got, want), (dtype, tiles, (got.float() - want.float()).abs().max().item())
        try:
            fp8_gemv_normed_linear(x, residual[:, :100], norm_weight, 1e-6, codes, rows)
        except ValueError as e:
            assert "residual (1, 100) must match x (1, 200)" in str(e), e
        else:
            raise AssertionError("a residual of another shape was accepted")
        for fn, args in ((fp8_gemv_linear, ()), (fp8_gemv_normed_linear, (residual.repeat(2, 1), norm_weight, 1e-6))):
            try:
                fn(x.repeat(2, 1), *args, codes, rows)
            except ValueError as e:
                assert "x (2, 200) must be one row of 200; more rows take ops/fp8_linear.py" in str(e), e
            else:
                raise AssertionError(f"{fn.__name__} took 2 rows")
    """, PRELUDE)


def test_a_few_row_w8a8_linear_splits_k_and_its_last_split_adds_the_chunks_in_order() -> None:
    """A verify step's few rows (ops/fp8_linear.py split_k): a launch whose tiles cover the GPU thinly sums
    its K chunks in separate programs and the last of a tile's programs to land adds them in split order and
    rounds once. Here 4 rows of 1000 -> 64 (8 K steps of 128, the last partial; 4 tiles on the interpreter's
    4 "SMs") split in two: the result is the unsplit launch's regrouped (equal to float32 rounding), the
    float32 chunk sums added in order exactly, and every arrival counter is zero again afterwards."""
    run_interpreted("""
        from fastdeploy_r3.model_executor.ops.arrivals import arrival_counters
        from fastdeploy_r3.model_executor.ops.fp8_linear import fp8_linear, split_k
        from fastdeploy_r3.model_executor.quantization.fp8 import expand_scale_rows, quantize_blockwise

        torch.manual_seed(3)
        codes, scale = quantize_blockwise(torch.randn(64, 1000) * 0.1)
        rows = expand_scale_rows(scale, 64)
        x = torch.randn(4, 1000)
        assert split_k(4, 4, 8, x.device) == 2 and split_k(17, 4, 8, x.device) == 1  # rows past 16: whole K
        got = fp8_linear(x, codes, rows, fp8_activations=True)
        saved, fp8_linear.__globals__["SPLIT_K_PROGRAMS"] = fp8_linear.__globals__["SPLIT_K_PROGRAMS"], 0
        try:
            whole = fp8_linear(x, codes, rows, fp8_activations=True)
            halves = [fp8_linear(x[:, :512], codes[:, :512], rows[:, :4], fp8_activations=True),
                      fp8_linear(x[:, 512:], codes[:, 512:], rows[:, 4:], fp8_activations=True)]
        finally:
            fp8_linear.__globals__["SPLIT_K_PROGRAMS"] = saved
        assert torch.allclose(got, whole, rtol=1e-5, atol=1e-6) and not torch.equal(got, whole)
        # each half quantizes its own groups as the whole row does (128-wide groups, 512 = 4 of them)
        assert torch.equal(got, halves[0] + halves[1])
        assert not arrival_counters(x.device, 1).any()
    """, PRELUDE)
