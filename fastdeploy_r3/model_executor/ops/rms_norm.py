"""RMSNorm (+ residual add) as one Triton kernel, with the torch reference it must agree with.

    rms_norm(x, w)            y = w * (x / rms(x)).to(dtype)                       x: [..., N]
    rms_norm(x, w, residual)  s = (x + residual).to(dtype);  y = rms_norm(s, w);   returns (y, s)

The reference is exactly what the HF models compute (variance in float32, the normalised value cast
back to the input dtype before the weight multiplies), so the CPU path is bit-identical to them. The
kernel rounds at the same points; only the order of the float32 sum of squares differs.

x may be a strided view [T, NH, D] (q or k heads inside the fused qkv output): rows are addressed
through two strides, so no copy is made before the kernel.
"""

from __future__ import annotations

import torch

from fastdeploy_r3.model_executor.ops.triton_setup import jit, pdl, pdl_prologue, tl, triton


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual  # [..., N] in the input dtype, as the unfused `x = x + f(x)` rounds it
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(dtype)
    return y if residual is None else (y, x)


@jit
def _rms_norm_kernel(
    x_ptr,  # [R0, R1, N] strided rows
    residual_ptr,  # [R0, R1, N] (HAS_RESIDUAL)
    weight_ptr,  # [N]
    out_ptr,  # [R0 * R1, N] contiguous
    residual_out_ptr,  # [R0 * R1, N] contiguous (HAS_RESIDUAL)
    rows_inner,  # R1
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)  # the next linear may stream its weights meanwhile (ops/triton_setup.py)
    row = tl.program_id(0).to(tl.int64)
    i0 = row // rows_inner
    i1 = row % rows_inner
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < N
    x = tl.load(x_ptr + i0 * stride_x0 + i1 * stride_x1 + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + i0 * stride_r0 + i1 * stride_r1 + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # the sum, rounded as torch rounds it
        tl.store(residual_out_ptr + row * N + cols, x, mask=mask)
    inv_rms = inverse_rms(x.to(tl.float32), N, eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * N + cols, weighted(x, inv_rms, w).to(out_ptr.dtype.element_ty), mask=mask)


# The norm's arithmetic, written once: _rms_norm_kernel, and the GEMVs that normalize a row as they load it
# (ops/fp8_gemv.py, ops/gemv.py) through row_inv_rms and normed_elements


@jit
def inverse_rms(v, n, eps):
    """1 / sqrt(mean(v^2) + eps) of a row's float32 values v (zeros past its n): the mean divided and the
    root and reciprocal taken IEEE-rounded, not with the fast approximations."""
    return tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(v * v, 0), n * 1.0) + eps))


@jit
def weighted(s, inv_rms, w):
    """w * (s * inv_rms).to(dtype) in float32, s in the row's dtype: the value rounded to the row's dtype
    before the weight multiplies, as the HF models do (rms_norm_ref)."""
    return w.to(tl.float32) * (s.to(tl.float32) * inv_rms).to(s.dtype).to(tl.float32)


@jit
def row_inv_rms(x_ptr, residual_ptr, n, eps, BLOCK: tl.constexpr):
    """1 / rms(x + residual) of one 16-bit row of n values (BLOCK >= n), the sum rounded to the row's dtype
    first, for a GEMV that normalizes its input row as it loads it. tests/gpu/test_fp8_w8a8_gpu.py holds the
    result to _rms_norm_kernel's, bit for bit, at hidden 2048 and 4096 in 4- and 8-warp GEMVs."""
    c = tl.arange(0, BLOCK)
    c_ok = c < n
    x = tl.load(x_ptr + c, mask=c_ok, other=0.0)
    r = tl.load(residual_ptr + c, mask=c_ok, other=0.0)
    return inverse_rms((x.to(tl.float32) + r.to(tl.float32)).to(x.dtype).to(tl.float32), n, eps)


@jit
def normed_elements(x, k, k_ok, inv_rms, residual_ptr, weight_ptr):
    """(w * (s * inv_rms).to(dtype), s) at elements k of the row whose loaded values are x, s = (x +
    residual).to(dtype): _rms_norm_kernel's output and sum there, rounded where it rounds them (the
    weight in x's dtype)."""
    s = (x.to(tl.float32) + tl.load(residual_ptr + k, mask=k_ok, other=0.0).to(tl.float32)).to(x.dtype)
    return weighted(s, inv_rms, tl.load(weight_ptr + k, mask=k_ok, other=0.0)).to(x.dtype), s


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of rms_norm_ref for x [T, N] or [T, NH, N] (last dim contiguous); outputs contiguous."""
    n = x.shape[-1]
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or weight.shape != (n,):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} must be [T, N] or [T, NH, N] with a contiguous last "
                         f"dimension and weight [{n}], got weight {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    x3 = x if x.dim() == 3 else x.unsqueeze(1)  # [R0, R1, N]
    r3 = x3 if residual is None else (residual if residual.dim() == 3 else residual.unsqueeze(1))
    # the output dtype is what `weight * x.to(x.dtype)` promotes to (x's dtype for a model cast to one dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    num_rows = x3.shape[0] * x3.shape[1]
    if num_rows:
        early = pdl(x)
        _rms_norm_kernel[(num_rows,)](
            x3, r3, weight, out, residual_out, x3.shape[1],
            x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), eps,
            N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None, PDL=early, launch_pdl=early,
        )  # fmt: skip
    return out if residual is None else (out, residual_out)
