"""W8A8 on the H200: dynamic per-row, 128-wide group fp8 activations (ops/fp8_quant.py) times block-wise fp8
weights, one fp8 MMA a K block (ops/fused_moe_triton.py FP8_A). CI has no GPU (tests/gpu/conftest.py skips
these there); run them through the device tool:

    python -m pytest -m gpu tests/gpu/test_fp8_w8a8_gpu.py -v -s

What they hold: the GPU's activation codes and scales are torch's, byte for byte; the dense linear and the
fused MoE equal a float32 torch reference that multiplies the same dequantised activations by the
dequantised weights, within the bf16 rounding of the output (and, in the MoE, of the intermediate that
is quantized again before the down projection); the one-row GEMV (ops/fp8_gemv.py) gives the tile
kernels' results on the same row up to their float32 summation order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from fastdeploy_r3.model_executor.ops.fp8_quant import quantize_groups, quantize_groups_reference
from fastdeploy_r3.model_executor.quantization.fp8 import dequantize, expand_scale_rows, quantize_blockwise

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activation_codes_and_scales_on_cuda_are_torchs(dtype: torch.dtype) -> None:
    x = (torch.randn(300, 2000, device=CUDA) * 3).to(dtype)
    x[7, 128:256] = 0  # an all-zero group: the floor scale, zero codes
    codes, scales = quantize_groups(x)
    want_codes, want_scales = quantize_groups_reference(x)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    cpu_codes, cpu_scales = quantize_groups_reference(x.cpu())
    assert torch.equal(scales.cpu(), cpu_scales)
    assert torch.equal(codes.cpu().view(torch.uint8), cpu_codes.view(torch.uint8))


@pytest.mark.parametrize("rows", [1, 64, 256, 2048])
def test_the_w8a8_dense_linear_equals_the_dequantised_operands_in_float32(rows: int) -> None:
    from fastdeploy_r3.model_executor.ops.fp8_linear import fp8_linear

    gen = torch.Generator(device=CUDA).manual_seed(0)
    for in_features, out_features in ((2048, 5120), (4096, 2048)):
        codes, scale = quantize_blockwise(torch.randn(out_features, in_features, device=CUDA, generator=gen) * 0.02)
        scale_rows = expand_scale_rows(scale, out_features)
        x = torch.randn(rows, in_features, device=CUDA, generator=gen).bfloat16()
        x_codes = dequantize(*quantize_groups_reference(x), torch.float32)  # [rows, I] what the kernel multiplies
        want = F.linear(x_codes, dequantize(codes, scale_rows, torch.float32))
        got = fp8_linear(x, codes, scale_rows, fp8_activations=True).float()
        rel = ((got - want).norm() / want.norm()).item()
        print(f"\nw8a8 linear {in_features}->{out_features}, {rows} rows: relative L2 {rel:.1e}")
        assert rel < 4e-3, rel  # the output's bf16 rounding, ~2e-3


def _expert_stack(gen: torch.Generator, out_features: int, in_features: int,
                  num_experts: int = 128) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Random experts quantized block-wise: codes [E, O, I] and scale rows [E, O, ceil(I/128)] (O is a
    multiple of 128, so the stacked rows quantize as E separate weights)."""
    codes, scale = quantize_blockwise(
        torch.randn(num_experts * out_features, in_features, device=CUDA, generator=gen) * 0.02)
    rows = expand_scale_rows(scale, num_experts * out_features)
    return codes.view(num_experts, out_features, -1), rows.view(num_experts, out_features, -1)


@pytest.mark.parametrize("num_tokens", [1, 64, 256])
def test_the_w8a8_fused_moe_equals_a_float32_loop_on_the_same_codes(num_tokens: int) -> None:
    from fastdeploy_r3.model_executor.ops.fused_moe_triton import TritonMoeConfig, triton_experts

    gen = torch.Generator(device=CUDA).manual_seed(0)
    num_experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13, w2 = _expert_stack(gen, 2 * inter, hidden), _expert_stack(gen, hidden, inter)
    x = torch.randn(num_tokens, hidden, device=CUDA, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(num_experts, device=CUDA, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, device=CUDA, generator=gen)
    for cfg in (TritonMoeConfig(16, 64, 128, 4, 3), TritonMoeConfig(64, 128, 128, 8, 3)):
        got = triton_experts(x, w13[0], w2[0], weights, ids, cfg, w13_scale=w13[1], w2_scale=w2[1],
                             fp8_activations=True).float()  # fmt: skip
        xd = dequantize(*quantize_groups_reference(x), torch.float32)  # [T, H]
        want = torch.zeros(num_tokens, hidden, device=CUDA)
        for t in range(num_tokens):
            e = ids[t]
            g = torch.einsum("h,kih->ki", xd[t], dequantize(w13[0][e], w13[1][e], torch.float32)).bfloat16().float()
            act = (F.silu(g[:, :inter]) * g[:, inter:]).bfloat16()  # [K, I], as the kernel stores it
            down = torch.einsum("ki,khi->kh", dequantize(*quantize_groups_reference(act), torch.float32),
                                dequantize(w2[0][e], w2[1][e], torch.float32))  # fmt: skip
            want[t] = (down.bfloat16().float() * weights[t][:, None]).sum(0)
        rel = ((got - want).norm() / want.norm()).item()
        print(f"\nw8a8 fused MoE {cfg}, {num_tokens} tokens: relative L2 {rel:.1e}")
        assert rel < 1e-2, rel  # bf16 roundings of gate, up, act, down and out (an act code may flip)


def _median_ms(fn) -> float:  # noqa: ANN001
    """Median milliseconds of fn() on the GPU (tools/bench_moe.py's event timing, 50 runs)."""
    from bench_moe import time_fn

    return time_fn(fn, reps=50) * 1e3


def test_the_one_row_gemv_equals_the_w8a8_tile_kernels_at_qwen3_shapes() -> None:
    """ops/fp8_gemv.py against the W8A8 tile kernels on the same bf16 row: the same codes and scales, so
    only the float32 summation order differs (a few outputs round to the neighbouring bf16); times printed."""
    from fastdeploy_r3.model_executor.ops.fp8_gemv import fp8_gemv_experts, fp8_gemv_linear
    from fastdeploy_r3.model_executor.ops.fp8_linear import fp8_linear
    from fastdeploy_r3.model_executor.ops.fused_moe_triton import triton_experts

    gen = torch.Generator(device=CUDA).manual_seed(0)
    for in_features, out_features in ((2048, 5120), (4096, 2048)):
        codes, scale = quantize_blockwise(torch.randn(out_features, in_features, device=CUDA, generator=gen) * 0.02)
        scale_rows = expand_scale_rows(scale, out_features)
        x = torch.randn(1, in_features, device=CUDA, generator=gen).bfloat16()
        tile = fp8_linear(x, codes, scale_rows, fp8_activations=True).float()
        got = fp8_gemv_linear(x, codes, scale_rows).float()
        rel = ((got - tile).norm() / tile.norm()).item()
        args = (x, codes, scale_rows)
        ms = (_median_ms(lambda a=args: fp8_gemv_linear(*a)),
              _median_ms(lambda a=args: fp8_linear(*a, fp8_activations=True)))  # fmt: skip
        print(f"\ngemv linear {in_features}->{out_features}: relative L2 to the tile kernel {rel:.1e}, "
              f"gemv {ms[0]:.4f} ms, tile {ms[1]:.4f} ms")
        assert rel < 2e-3, rel

    num_experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13, w2 = _expert_stack(gen, 2 * inter, hidden), _expert_stack(gen, hidden, inter)
    x = torch.randn(1, hidden, device=CUDA, generator=gen).bfloat16()
    ids = torch.randperm(num_experts, device=CUDA, generator=gen)[:top_k][None]
    weights = torch.rand(1, top_k, device=CUDA, generator=gen)

    def gemv() -> torch.Tensor:
        return fp8_gemv_experts(x, w13[0], w13[1], w2[0], w2[1], weights, ids)

    def tile() -> torch.Tensor:
        return triton_experts(x, w13[0], w2[0], weights, ids, w13_scale=w13[1], w2_scale=w2[1])

    got, want = gemv().float(), tile().float()
    rel = ((got - want).norm() / want.norm()).item()
    print(f"\ngemv fused MoE: relative L2 to the tile kernels {rel:.1e}, gemv {_median_ms(gemv):.4f} ms, "
          f"tile {_median_ms(tile):.4f} ms")
    assert rel < 5e-3, rel  # the intermediate's codes can differ where its bf16 rounding did
