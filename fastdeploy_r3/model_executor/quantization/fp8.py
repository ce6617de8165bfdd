"""Block-wise FP8 weights (the DeepSeek-V3 / Qwen3-FP8 checkpoint format): loading, quantization, serving.

Checkpoint layout (per quantized Linear, and per expert projection):

    X.weight            [O, I]                     float8_e4m3fn
    X.weight_scale_inv  [ceil(O/128), ceil(I/128)] float32 (bf16 accepted: converted exactly)
    dequantised         w[o, i] = weight[o, i] * weight_scale_inv[o // 128, i // 128]

Edge blocks of a shape that is not a multiple of 128 are partial; their scale covers only the rows
and columns that exist. Online quantization (a bf16/float32 weight arriving for a quantized layer)
uses the same blocks: scale = amax(|block|) / 448, weight = round-to-nearest-fp8(w / scale).

Served layout: a layer holds `weight` (fp8, its own [O, I]) and `weight_scale_inv` expanded along the
output rows, [O, ceil(I/128)] float32 (row o carries its block row's scales). The expansion lets the
loaders stack q/k/v, gate/up and tensor-parallel row slices whose block rows do not line up with the
stacked tensor's (a tiny model's 48 q rows, then k), at 4 bytes per 128 weights (3 % of the fp8 bytes).
"""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy_r3.model_executor.batch_invariant import linear
from fastdeploy_r3.model_executor.layers.fused_moe import choose_backend
from fastdeploy_r3.model_executor.ops.fp8_gemv import fp8_gemv_experts, fp8_gemv_linear, fp8_gemv_normed_linear
from fastdeploy_r3.model_executor.ops.fp8_linear import MAX_ROWS as FP8_LINEAR_MAX_ROWS
from fastdeploy_r3.model_executor.ops.fp8_linear import fp8_linear
from fastdeploy_r3.model_executor.ops.fused_moe_triton import triton_experts
from fastdeploy_r3.model_executor.ops.gemv import use_one_row_gemv
from fastdeploy_r3.model_executor.ops.moe_align import MoeBlocks
from fastdeploy_r3.model_executor.quantization.base import LinearMethod, MoEMethod

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128  # weight_block_size [128, 128], the only one served
# one row of 16-bit activations (a batch-1 decode step) takes ops/fp8_gemv.py: W8A8 like the tile kernels,
# which spend a 16-row MMA on it (tools/bench_fp8.py --modes gemv measures both)
ONE_ROW_GEMV = True
# ... and takes the decoder layer's input RMSNorm into the qkv projection's GEMV (apply_normed): tools/bench_r3.py,
# batch-1 fp8 step, pipelined, one call on the H200: 2.63, 2.63 ms fused against 2.66 with the norm's own launch
FUSED_NORM = True
# the fused MoE of 1 to this many 16-bit tokens takes ops/fp8_gemv.py too (the dense linears one row only).
# fp8 Qwen3-30B-A3B on the H200: the batch-1 k = 3 verify graph 4.42-4.46 ms against 4.70-4.76 with the tile
# kernels (in-process, 30 replays); tools/bench_spec.py pipelined decode steps (ms, two runs each, this / the
# tile kernels): batch 2 3.62, 3.63 / 4.01, 4.01; batch 4 4.57, 4.57 / 4.86, 4.86; up to 8 tokens lost at
# batch 8 (6.84, 6.84 / 6.69, 6.69). docs/perf_h200.md, 2026-12-04, fifth session
GEMV_MOE_MAX_TOKENS = 4
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
# amax floor: an all-zero block gets a tiny positive scale and zero codes instead of 0 / 0
_AMAX_FLOOR = 1e-12


def scale_shape(weight_shape: tuple[int, ...], block: int = BLOCK) -> tuple[int, int]:
    """The checkpoint scale's shape for a [O, I] weight: (ceil(O / block), ceil(I / block))."""
    out_features, in_features = weight_shape
    return -(-out_features // block), -(-in_features // block)


def quantize_blockwise(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] (any float dtype) -> (fp8 [O, I], weight_scale_inv float32 [ceil(O/128), ceil(I/128)]).

    Computed in float32 whatever w's dtype, so a bf16 tensor and the float32 tensor holding the same
    values quantize to the same bytes."""
    out_features, in_features = w.shape
    rows, cols = scale_shape((out_features, in_features), block)
    padded = w.new_zeros((rows * block, cols * block), dtype=torch.float32)
    padded[:out_features, :in_features] = w.float()
    blocks = padded.view(rows, block, cols, block)  # [R, 128, C, 128]
    amax = blocks.abs().amax(dim=(1, 3))  # [R, C]
    # divided by a tensor, not the Python scalar: CUDA divides by a scalar as a multiply by its reciprocal
    # (1/448 is inexact), which made some scales one ulp off the CPU's correctly rounded quotient
    scale = amax.clamp(min=_AMAX_FLOOR) / torch.full_like(amax, FP8_MAX)  # [R, C]
    # w / scale is at most 448 up to one rounding: clamp, since out-of-range values do not saturate in .to()
    codes = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes.view(rows * block, cols * block)[:out_features, :in_features].contiguous(), scale


def expand_scale_rows(scale: torch.Tensor, out_features: int, block: int = BLOCK) -> torch.Tensor:
    """Checkpoint scale [ceil(O/128), C] -> served scale [O, C] (row o holds block row o // 128)."""
    return scale.float().repeat_interleave(block, dim=0)[:out_features].contiguous()


def dequantize(weight: torch.Tensor, scale_rows: torch.Tensor, dtype: torch.dtype, block: int = BLOCK) -> torch.Tensor:
    """fp8 weight [..., O, I] and served scale [..., O, ceil(I/128)] -> the weight in `dtype`.

    The product is taken in float32 (exact: an fp8 code times a float32 scale rounds once) and then cast
    to the compute dtype, so float32 compute sees exactly fp8 * scale."""
    in_features = weight.shape[-1]
    if in_features % block == 0:  # whole column blocks: broadcast the scale, no [..., O, I] scale copy
        blocks = weight.float().unflatten(-1, (in_features // block, block))  # [..., O, I/128, 128]
        return (blocks * scale_rows.unsqueeze(-1)).flatten(-2).to(dtype)
    per_column = scale_rows.repeat_interleave(block, dim=-1)[..., :in_features]  # [..., O, I]
    return (weight.float() * per_column).to(dtype)


class Fp8LinearMethod(LinearMethod):
    """y = x dequantize(W)^T (+ b) with FP8 weights.

    On CUDA, up to ops/fp8_linear.py's MAX_ROWS rows, a Triton kernel reads the fp8 tiles of W and their
    scale rows: no dequantised W in memory, one byte per weight read. 16-bit activations are quantized
    per row and 128-wide group too and the kernel runs fp8 MMAs (W8A8, the published checkpoints' dynamic
    activation scheme); float32 ones stay as they are (weight-only, each tile dequantised as it is loaded).
    One 16-bit row takes the same W8A8 arithmetic on the CUDA cores (ops/fp8_gemv.py). Elsewhere (the
    CPU, the longest prefill chunks, deterministic mode's fixed-tile matmul) W is dequantised and the
    plain linear runs."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        layer.weight_scale_inv = nn.Parameter(  # [O, ceil(I/128)]
            torch.empty(out_features, scale_shape((out_features, in_features))[1], dtype=torch.float32),
            requires_grad=False,
        )
        layer.bias = nn.Parameter(torch.empty(out_features)) if bias else None  # [O], the model dtype

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # W8A8 for 16-bit x (ops/fp8_linear.py's docstring): fp8 MMAs
        if x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= FP8_LINEAR_MAX_ROWS and not layer.batch_invariant:
            if _takes_gemv(layer, x):
                y = fp8_gemv_linear(x, layer.weight, layer.weight_scale_inv)  # [1, O]
            else:
                y = fp8_linear(x, layer.weight, layer.weight_scale_inv)  # [T, O]
            return y if bias is None else y.add_(bias)
        w = dequantize(layer.weight, layer.weight_scale_inv, x.dtype)  # [O, I]
        return linear(x, w, bias, batch_invariant=layer.batch_invariant)  # [T, O]

    def apply_normed(self, layer: nn.Module, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None,
                     bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """One row: the norm and its residual add inside the GEMV's loads (ops/fp8_gemv.py
        fp8_gemv_normed_linear), one launch less; the same roundings as the norm kernel then the GEMV."""
        if FUSED_NORM and residual is not None and _takes_gemv(layer, x) and norm.weight.dtype == x.dtype:
            y, total = fp8_gemv_normed_linear(x, residual, norm.weight, norm.eps, layer.weight, layer.weight_scale_inv)
            return (y if bias is None else y.add_(bias)), total
        return super().apply_normed(layer, x, norm, residual, bias)


class Fp8MoEMethod(MoEMethod):
    """Stacked experts in fp8: w13 [E, 2I, H] with w13_weight_scale_inv [E, 2I, ceil(H/128)], w2 [E, H, I]
    with w2_weight_scale_inv [E, H, ceil(I/128)]; gate and up keep their own checkpoint blocks (rows).

    apply: on CUDA (the Triton fused MoE, which the auto backend also takes for eager prefill here) the
    kernel reads the fp8 tiles and their scale rows (ops/fused_moe_triton.py, FP8_W): the weights cross
    HBM at one byte each. With 16-bit activations x and the intermediate are quantized per row and
    128-wide group too (W8A8, pick_fp8_config), at every batch size; with float32 ones each tile is
    dequantised as it is loaded (the bits of the plain kernel on the dequantised weights). 1 to
    GEMV_MOE_MAX_TOKENS 16-bit tokens (outside deterministic mode) take ops/fp8_gemv.py, the same W8A8
    arithmetic on the CUDA cores. Elsewhere (the CPU loop, an explicit grouped_mm backend) it dequantises
    every expert and runs the plain-weight backend."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        two_inter = 2 * intermediate_size
        layer.w13 = nn.Parameter(torch.empty(num_experts, two_inter, hidden_size, dtype=FP8_DTYPE),
                                 requires_grad=False)
        layer.w13_weight_scale_inv = nn.Parameter(
            torch.empty(num_experts, two_inter, scale_shape((two_inter, hidden_size))[1], dtype=torch.float32),
            requires_grad=False,
        )
        layer.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=FP8_DTYPE),
                                requires_grad=False)
        layer.w2_weight_scale_inv = nn.Parameter(
            torch.empty(num_experts, hidden_size, scale_shape((hidden_size, intermediate_size))[1],
                        dtype=torch.float32),
            requires_grad=False,
        )

    def apply(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        blocks: MoeBlocks | None = None,
    ) -> torch.Tensor:  # fmt: skip
        backend = choose_backend(layer.backend, x, layer.batch_invariant)
        # on CUDA the auto backend's eager grouped_mm would dequantise all E experts first: the Triton kernel
        # reads the codes (W8A8 for 16-bit activations, prefill included)
        if backend == "triton" or (backend == "grouped_mm" and layer.backend == "auto"):
            if _takes_gemv(layer, x, GEMV_MOE_MAX_TOKENS):
                return fp8_gemv_experts(x, layer.w13, layer.w13_weight_scale_inv, layer.w2, layer.w2_weight_scale_inv,
                                        topk_weights, topk_ids)  # fmt: skip
            return triton_experts(x, layer.w13, layer.w2, topk_weights, topk_ids, blocks=blocks,
                                  w13_scale=layer.w13_weight_scale_inv, w2_scale=layer.w2_weight_scale_inv,
                                  batch_invariant=layer.batch_invariant)  # fmt: skip
        w13 = dequantize(layer.w13, layer.w13_weight_scale_inv, x.dtype)  # [E, 2I, H]
        w2 = dequantize(layer.w2, layer.w2_weight_scale_inv, x.dtype)  # [E, H, I]
        return layer.run_experts(x, w13, w2, topk_weights, topk_ids, blocks)

    def uses_alignment(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """The GEMV reads topk_ids as they are: its routing skips the alignment."""
        return not _takes_gemv(layer, x, GEMV_MOE_MAX_TOKENS)


def _takes_gemv(layer: nn.Module, x: torch.Tensor, max_rows: int = 1) -> bool:
    """1 to max_rows rows of 16-bit activations on CUDA outside deterministic mode: ops/fp8_gemv.py's case
    (ONE_ROW_GEMV), the dense linears at one row (a batch-1 decode step), the MoE at GEMV_MOE_MAX_TOKENS."""
    return ONE_ROW_GEMV and use_one_row_gemv(x, layer.batch_invariant, max_rows)
