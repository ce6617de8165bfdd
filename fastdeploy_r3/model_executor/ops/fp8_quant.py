"""Dynamic fp8 activations for the W8A8 GEMMs (ops/fused_moe_triton.py FP8_A): each row cut in groups of
128 columns, each group scaled by its own amax / 448 and rounded to float8_e4m3fn.

    x [M, C] (bf16 / fp16 / float32)  ->  codes [M, C] float8_e4m3fn,  scales [M, ceil(C/128)] float32
    x[m, c] ~= codes[m, c] * scales[m, c // 128]   (quantization/fp8.py dequantize(codes, scales, dtype))

The group is the weights' 128-wide K block (quantization/fp8.py), so one K step of the GEMM multiplies
an fp8 tile of x by an fp8 tile of W and scales the float32 product once by both scales: the layout of
DeepSeek-V3's and Qwen3-FP8's "activation_scheme": "dynamic" checkpoints. quantize_groups_reference
is the same arithmetic in torch (the CPU tests hold the kernel to it).
"""

from __future__ import annotations

import torch

from fastdeploy_r3.model_executor.ops.triton_setup import INTERPRET, jit, require_triton, tl, triton

GROUP = 128
# the model dtypes as Triton dtypes (the W8A8 kernels' ACT_DTYPE constexpr: what their outputs round to)
TL_DTYPES = {} if tl is None else {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
FP8_MAX = 448.0
_AMAX_FLOOR = 1e-10  # an all-zero group: a tiny positive scale and zero codes, never 0 / 0


@jit
def group_quotients(v):
    """v [R, GROUP] float32 -> (scales [R], quotients [R, GROUP]): each row's amax / 448 (floored, never
    0 / 0) and v / scale correctly rounded and clamped to +-448, the value the e4m3 code rounds. The one
    place this arithmetic is written: this module's kernel and ops/fp8_gemv.py's in-kernel quantization
    (_AMAX_FLOOR and FP8_MAX as literals: a jit function reads no plain module global)."""
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(v), axis=1), 1e-10), 448.0)  # [R]
    return scale, tl.clamp(tl.div_rn(v, scale[:, None]), -448.0, 448.0)


@jit
def e4m3_round(q):
    """q (float32, already clamped to [-448, 448]) rounded to the nearest float8_e4m3fn value, ties to even,
    as float32: what q.to(float8_e4m3fn).to(float32) gives on the GPU, computed with float32 arithmetic only
    (the interpreter's float32 -> e4m3 cast is wrong at binade edges, see quantize_groups). The quantum of
    q's binade is 2^(e - 3) (3 mantissa bits), 2^-9 for e4m3's subnormals; q / quantum is below 16, so
    adding and taking away 1.5 * 2^23 rounds it to an integer, ties to even."""
    e = ((q.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # q's binary exponent (-127 for 0)
    e = tl.maximum(e, -6)
    quantum = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    inverse = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
    return ((q * inverse + 12582912.0) - 12582912.0) * quantum


@jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, rows, cols, stride_x, stride_q, stride_s,
                            GROUP_SIZE: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """One program: ROWS rows x one group of GROUP_SIZE columns."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [R]
    g = tl.program_id(1)
    c = g * GROUP_SIZE + tl.arange(0, GROUP_SIZE)  # [G]
    ok = (r < rows)[:, None] & (c < cols)[None, :]
    v = tl.load(x_ptr + r[:, None].to(tl.int64) * stride_x + c[None, :], mask=ok, other=0.0).to(tl.float32)
    scale, q = group_quotients(v)  # [R], [R, G]
    tl.store(q_ptr + r[:, None].to(tl.int64) * stride_q + c[None, :], q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + r.to(tl.int64) * stride_s + g, scale, mask=r < rows)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, C] -> (codes [M, C] float8_e4m3fn, scales [M, ceil(C/128)] float32), in one launch."""
    require_triton("quantize_groups")
    rows, cols = x.shape
    groups = triton.cdiv(cols, GROUP)
    # the interpreter's float32 -> e4m3 cast rounds a value just under a power of two down a binade (124.3
    # -> 64): under INTERPRET the kernel stores the clamped quotients and torch rounds them (RNE, as the GPU)
    codes = torch.empty(rows, cols, dtype=torch.float32 if INTERPRET else torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows == 0:
        return codes, scales
    if x.stride(1) != 1:
        x = x.contiguous()
    block_rows = 4
    _quantize_groups_kernel[(triton.cdiv(rows, block_rows), groups)](
        x, codes, scales, rows, cols, x.stride(0), codes.stride(0), scales.stride(0),
        GROUP_SIZE=GROUP, ROWS=block_rows,
    )  # fmt: skip
    return (codes.to(torch.float8_e4m3fn) if INTERPRET else codes), scales


def quantize_groups_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_groups in torch: the same floor, the same correctly rounded quotient, the same clamp."""
    rows, cols = x.shape
    groups = -(-cols // GROUP)
    padded = x.new_zeros((rows, groups * GROUP), dtype=torch.float32)
    padded[:, :cols] = x.float()
    blocks = padded.view(rows, groups, GROUP)
    scale = blocks.abs().amax(dim=2).clamp(min=_AMAX_FLOOR) / torch.full((rows, groups), FP8_MAX, device=x.device)
    codes = (blocks / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(rows, groups * GROUP)[:, :cols].contiguous(), scale


@jit
def _e4m3_values_kernel(q_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    q = tl.load(q_ptr + i, mask=i < numel, other=0.0)
    tl.store(out_ptr + i, e4m3_round(tl.clamp(q, -448.0, 448.0)), mask=i < numel)


def e4m3_values(q: torch.Tensor) -> torch.Tensor:
    """float32 q clamped to [-448, 448] and rounded by e4m3_round, as ops/fp8_gemv.py rounds activation
    codes (the tests hold it to torch's float8_e4m3fn cast)."""
    require_triton("e4m3_values")
    q = q.float().contiguous()
    out = torch.empty_like(q)
    _e4m3_values_kernel[(triton.cdiv(q.numel(), 1024),)](q, out, q.numel(), BLOCK=1024)
    return out
