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


@pytest.mark.parametrize("rows", [1, 4, 64, 256, 2048])
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


@pytest.mark.parametrize("rows", [1, 4])
def test_the_gemv_equals_the_w8a8_tile_kernels_at_qwen3_shapes(rows: int) -> None:
    """ops/fp8_gemv.py against the W8A8 tile kernels on the same bf16 rows (the dense GEMV's one; the MoE's
    one, and a verify step's 4): the same codes and scales, so only the float32 summation order differs (a
    few outputs round to the neighbouring bf16); each of 4 tokens gets the bits it gets alone; times printed."""
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
    x = torch.randn(rows, hidden, device=CUDA, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(num_experts, device=CUDA, generator=gen)[:top_k] for _ in range(rows)])
    weights = torch.rand(rows, top_k, device=CUDA, generator=gen)

    def gemv() -> torch.Tensor:
        return fp8_gemv_experts(x, w13[0], w13[1], w2[0], w2[1], weights, ids)

    def tile() -> torch.Tensor:
        return triton_experts(x, w13[0], w2[0], weights, ids, w13_scale=w13[1], w2_scale=w2[1])

    got, want = gemv().float(), tile().float()
    rel = ((got - want).norm() / want.norm()).item()
    for r in range(rows):
        one = fp8_gemv_experts(x[r : r + 1], w13[0], w13[1], w2[0], w2[1], weights[r : r + 1], ids[r : r + 1])
        assert torch.equal(got[r], one[0].float()), r
    print(f"\ngemv fused MoE: relative L2 to the tile kernels {rel:.1e}, gemv {_median_ms(gemv):.4f} ms, "
          f"tile {_median_ms(tile):.4f} ms")
    assert rel < 5e-3, rel  # the intermediate's codes can differ where its bf16 rounding did


def test_a_decode_layers_kernels_launched_early_in_a_cuda_graph_give_the_bits_of_plain_launches() -> None:
    """Programmatic dependent launch (ops/triton_setup.py): the one-row GEMVs start while the norm, the
    attention or the routing before them runs, stream weights, and wait for their inputs. One layer's
    chain (the qkv GEMV with the input norm + residual inside, a norm, the router gate's GEMV (ops/gemv.py),
    fused routing with the R3 capture, the gate's GEMV with a norm inside, the experts' two GEMV launches)
    recorded in a CUDA graph with PDL
    and replayed on new inputs equals the same chain launched eagerly without PDL, bit for bit."""
    from fastdeploy_r3.model_executor.ops import triton_setup
    from fastdeploy_r3.model_executor.ops.fp8_gemv import fp8_gemv_experts, fp8_gemv_normed_linear
    from fastdeploy_r3.model_executor.ops.fused_routing import RouterSpec, fused_routing
    from fastdeploy_r3.model_executor.ops.gemv import normed_gemv, router_gate
    from fastdeploy_r3.model_executor.ops.rms_norm import rms_norm

    gen = torch.Generator(device=CUDA).manual_seed(1)
    hidden, inter, num_experts, top_k = 2048, 768, 128, 8
    assert triton_setup.pdl(torch.empty(1, device=CUDA)), "the H200 launches these kernels with PDL"
    codes, scale = quantize_blockwise(torch.randn(5120, hidden, device=CUDA, generator=gen) * 0.02)
    qkv = (codes, expand_scale_rows(scale, 5120))
    w13, w2 = _expert_stack(gen, 2 * inter, hidden), _expert_stack(gen, hidden, inter)
    norm_w = torch.rand(hidden, device=CUDA, generator=gen).bfloat16() + 0.5
    gate = (torch.randn(num_experts, hidden, device=CUDA, generator=gen) * 0.05).bfloat16()
    gate_linear = torch.nn.Linear(hidden, num_experts, bias=False, device=CUDA, dtype=torch.bfloat16)
    gate_linear.weight.data.copy_(gate)
    spec = RouterSpec(top_k, "softmax", renormalize=True)
    x, res = (torch.randn(1, hidden, device=CUDA, generator=gen).bfloat16() for _ in range(2))
    capture = torch.full((4, 1, top_k), -1, dtype=torch.int32, device=CUDA)

    def layer() -> tuple[torch.Tensor, ...]:
        q, r = fp8_gemv_normed_linear(x, res, norm_w, 1e-6, *qkv)  # [1, 5120], the input norm inside
        h2 = rms_norm(q[:, :hidden], norm_w, 1e-6)
        routed = fused_routing(router_gate(h2, gate_linear), spec, None, capture, 0)  # the one-row GEMV
        out_a = q[:, hidden : 2 * hidden].contiguous()  # stands in for the attention's output row
        logits, h3, r3 = normed_gemv(out_a, r, norm_w, 1e-6, gate)
        out = fp8_gemv_experts(h2, w13[0], w13[1], w2[0], w2[1], routed.topk_weights, routed.topk_ids)
        return r, q, routed.topk_ids, capture[0].clone(), out, logits, h3, r3, out_a

    def plain() -> list[torch.Tensor]:
        triton_setup.PDL_ENABLED = False
        try:
            return [t.clone() for t in layer()]
        finally:
            triton_setup.PDL_ENABLED = True

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer()  # compile (and make the arrival counters) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = layer()
    for seed in range(4):
        torch.manual_seed(seed)
        x.copy_(torch.randn(1, hidden, device=CUDA))
        res.copy_(torch.randn(1, hidden, device=CUDA))
        capture.fill_(-1)
        graph.replay()
        got = [t.clone() for t in outs]
        want = plain()
        names = ("residual", "qkv", "ids", "capture", "experts", "normed gate", "normed row", "sum", "row")
        for name, g, w in zip(names, got, want, strict=True):
            assert torch.equal(g, w), (seed, name)


def test_the_router_gate_gemv_is_torchs_linear_within_one_bf16_ulp() -> None:
    """ops/gemv.py at the Qwen3-30B-A3B gate shape against cuBLAS: float32 sums in another order, so each
    logit is torch's or a neighbouring bf16 value; the times are printed."""
    from fastdeploy_r3.model_executor.ops.gemv import one_row_gemv

    gen = torch.Generator(device=CUDA).manual_seed(2)
    gate = (torch.randn(128, 2048, device=CUDA, generator=gen) * 0.05).bfloat16()
    x = torch.randn(4, 2048, device=CUDA, generator=gen).bfloat16()  # a k = 3 verify step's rows
    rows = one_row_gemv(x, gate)
    assert torch.equal(rows, torch.cat([one_row_gemv(x[i : i + 1], gate) for i in range(4)]))
    x = x[:1]
    got, want = one_row_gemv(x, gate).float(), F.linear(x, gate).float()
    exact = (x.double() @ gate.double().T).float()
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp(min=1e-3)
    assert ((got - exact).abs() <= ulp).all() and ((want - exact).abs() <= ulp).all()
    print(f"\nrouter gate 2048->128: gemv {_median_ms(lambda: one_row_gemv(x, gate)):.4f} ms, "
          f"torch {_median_ms(lambda: F.linear(x, gate)):.4f} ms, {(got != want).sum().item()} of 128 logits differ")


@pytest.mark.parametrize("hidden", [2048, 4096])
def test_the_gemvs_with_the_norm_before_them_inside_give_the_norm_kernel_then_the_gemv(hidden: int) -> None:
    """ops/fp8_gemv.py fp8_gemv_normed_linear (a batch-1 step's input RMSNorm and residual add inside the qkv
    GEMV, Qwen3-30B-A3B's and GLM-4.5-Air's hidden sizes): the bits of ops/rms_norm.py's kernel followed
    by the one-row GEMV, eagerly and replayed in a CUDA graph with early launches; ops/gemv.py normed_gemv
    (the post-attention norm inside the router gate's GEMV), at 1 row and a verify step's 4: the norm
    kernel's rows and sums, and their logits."""
    from fastdeploy_r3.model_executor.ops.fp8_gemv import fp8_gemv_linear, fp8_gemv_normed_linear
    from fastdeploy_r3.model_executor.ops.rms_norm import rms_norm

    gen = torch.Generator(device=CUDA).manual_seed(2)
    codes, scale = quantize_blockwise(torch.randn(5120, hidden, device=CUDA, generator=gen) * 0.02)
    rows = expand_scale_rows(scale, 5120)
    norm_w = torch.rand(hidden, device=CUDA, generator=gen).bfloat16() + 0.5
    x, res = (torch.randn(1, hidden, device=CUDA, generator=gen).bfloat16() * 4 for _ in range(2))

    def unfused() -> tuple[torch.Tensor, torch.Tensor]:
        h, total = rms_norm(x, norm_w, 1e-6, res)
        return fp8_gemv_linear(h, codes, rows), total

    from fastdeploy_r3.model_executor.ops.gemv import normed_gemv, one_row_gemv

    gate = (torch.randn(128, hidden, device=CUDA, generator=gen) * 0.05).bfloat16()
    logits, h, total = normed_gemv(x, res, norm_w, 1e-6, gate)  # the router gate's GEMV with the norm inside
    want_h, want_total = rms_norm(x, norm_w, 1e-6, res)
    assert torch.equal(h, want_h) and torch.equal(total, want_total) and torch.equal(logits, one_row_gemv(h, gate))
    got = fp8_gemv_normed_linear(x, res, norm_w, 1e-6, codes, rows)
    want = unfused()
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (got[0].float() - want[0].float()).abs().max()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fp8_gemv_normed_linear(x, res, norm_w, 1e-6, codes, rows)
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn(1, hidden, device=CUDA) * 4)
        res.copy_(torch.randn(1, hidden, device=CUDA))
        graph.replay()
        want = unfused()
        assert torch.equal(outs[0], want[0]) and torch.equal(outs[1], want[1]), seed
    # a verify step's 4 rows: the gate GEMV with the norm inside gives the norm kernel's rows and sums, and
    # the logits of those rows
    x4, res4 = (torch.randn(4, hidden, device=CUDA, generator=gen).bfloat16() * 4 for _ in range(2))
    h4, total4 = rms_norm(x4, norm_w, 1e-6, res4)
    logits4, h4_got, total4_got = normed_gemv(x4, res4, norm_w, 1e-6, gate)
    assert torch.equal(h4_got, h4) and torch.equal(total4_got, total4)
    assert torch.equal(logits4, one_row_gemv(h4, gate))


def test_a_verify_steps_few_row_linears_split_over_k_agree_with_the_whole_sum_and_replay_in_a_graph() -> None:
    """4 rows (a k = 3 verify step) of Qwen3-30B-A3B's qkv and o: fp8_linear splits the reduction over K
    (ops/fp8_linear.py split_k) and the last split of each tile adds the chunks in order. The result is the
    unsplit launch's up to the regrouped float32 sum (within |y| / 128, a bf16 rounding step), the same bits
    on every launch and on every replay of a CUDA graph holding the launch (the arrival counters are zero
    again after each)."""
    from fastdeploy_r3.model_executor.ops import fp8_linear as fl
    from fastdeploy_r3.model_executor.ops.arrivals import arrival_counters

    gen = torch.Generator(device=CUDA).manual_seed(4)
    for in_features, out_features in ((2048, 5120), (4096, 2048)):
        codes, scale = quantize_blockwise(torch.randn(out_features, in_features, device=CUDA, generator=gen) * 0.02)
        scale_rows = expand_scale_rows(scale, out_features)
        x = torch.randn(4, in_features, device=CUDA, generator=gen).bfloat16()
        assert fl.split_k(4, out_features // 16, in_features // 128, CUDA) > 1
        got = fl.fp8_linear(x, codes, scale_rows)
        fl.SPLIT_K_PROGRAMS, saved = 0, fl.SPLIT_K_PROGRAMS
        try:
            whole = fl.fp8_linear(x, codes, scale_rows)
        finally:
            fl.SPLIT_K_PROGRAMS = saved
        ulp = (whole.float().abs() * 2**-7).clamp_min(2**-133)
        assert ((got.float() - whole.float()).abs() <= ulp).all()
        assert all(torch.equal(fl.fp8_linear(x, codes, scale_rows), got) for _ in range(20))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fl.fp8_linear(x, codes, scale_rows)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fl.fp8_linear(x, codes, scale_rows)
        for _ in range(20):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, got)
        assert not arrival_counters(CUDA, 1).any()
