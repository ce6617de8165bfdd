"""Rotary embedding (neox layout, rotate halves; partial rotary) applied to q and k in place: one launch,
optionally fused with the per-head q/k RMSNorm before it (Qwen3).

    q [T, H, D], k [T, KVH, D]   (views into the fused qkv output are fine: last dim contiguous)
    cos, sin [T, R/2] float32    (RotaryEmbedding.cos_sin: the HF formula, computed once per forward)

    x1 = x[..., :R/2], x2 = x[..., R/2:R]     x1' = x1 cos - x2 sin,   x2' = x2 cos + x1 sin
    channels [R, D) pass through untouched.

The reference rounds as the HF code does in the model dtype (cos/sin cast to it, each product and the
sum rounded); the kernel rounds at the same points, and the interpreter matches it bit for bit. On the
H200 (2026-11-30) about 22 % of outputs differed from the reference by one step of the dtype, in float32
and bf16 alike (in float32 the compiler may contract a multiply and a subtract into one FMA; the bf16 cause
is not pinned down), so the GPU tests bound the error instead of asking for equality.
"""

from __future__ import annotations

import torch

from fastdeploy_r3.model_executor.ops.kv_cache_write import check_kv_write, write_token_kv
from fastdeploy_r3.model_executor.ops.triton_setup import jit, pdl, pdl_prologue, tl, triton

Q_HEADS_PER_PROGRAM = 8
# (v [T, KVH, D], k_cache [NB, BS, KVH, D], v_cache, slot_mapping [T]): where apply_rotary_ also writes k and v
KvTarget = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :r], x[..., r:]  # [T, H, R], [T, H, D - R]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q [T, H, D] and k [T, KVH, D]; cos/sin [T, R/2] float32."""
    cos_full = torch.cat((cos, cos), dim=-1).to(q.dtype)[:, None, :]  # [T, 1, R]
    sin_full = torch.cat((sin, sin), dim=-1).to(q.dtype)[:, None, :]  # [T, 1, R]
    return _rotate_ref(q, cos_full, sin_full), _rotate_ref(k, cos_full, sin_full)


@jit
def _norm_rotate_heads(
    x_ptr, t, h0, stride_t, stride_h, c, s, w_ptr, eps,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Heads [h0, h0 + BLOCK_H) of token t: [x1 | x2 | x_pass] = channels [0, R/2) | [R/2, R) | [R, D)."""
    h = h0 + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    mask = (h[:, None] < NUM_HEADS) & (r[None, :] < HALF)  # [BLOCK_H, BLOCK_R]
    offs = t * stride_t + h[:, None] * stride_h + r[None, :]
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0)
    dtype = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # per-head RMSNorm first (Qwen3's q_norm / k_norm), rounded to the dtype as its output is
        ss = tl.sum(x1f * x1f, 1) + tl.sum(x2f * x2f, 1)  # [BLOCK_H]
        if HEAD_DIM > 2 * HALF:
            p = 2 * HALF + tl.arange(0, BLOCK_P)  # [BLOCK_P] pass-through channels
            p_mask = (h[:, None] < NUM_HEADS) & (p[None, :] < HEAD_DIM)
            p_offs = t * stride_t + h[:, None] * stride_h + p[None, :]
            xpf = tl.load(x_ptr + p_offs, mask=p_mask, other=0.0).to(tl.float32)
            ss += tl.sum(xpf * xpf, 1)
        inv_rms = tl.div_rn(1.0, tl.sqrt_rn(ss / HEAD_DIM + eps))[:, None]  # [BLOCK_H, 1]
        w1 = tl.load(w_ptr + r, mask=r < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + r, mask=r < HALF, other=0.0).to(tl.float32)[None, :]
        x1f = (w1 * (x1f * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2f = (w2 * (x2f * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        if HEAD_DIM > 2 * HALF:
            wp = tl.load(w_ptr + p, mask=p < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
            xpf = (wp * (xpf * inv_rms).to(dtype).to(tl.float32)).to(dtype)
            tl.store(x_ptr + p_offs, xpf, mask=p_mask)
    c = c[None, :]
    s = s[None, :]
    # every product and sum rounded to the model dtype, as the torch expression evaluates it
    o1 = ((x1f * c).to(dtype).to(tl.float32) - (x2f * s).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((x2f * c).to(dtype).to(tl.float32) + (x1f * s).to(dtype).to(tl.float32)).to(dtype)
    tl.store(x_ptr + offs, o1, mask=mask)
    tl.store(x_ptr + offs + HALF, o2, mask=mask)


@jit
def _rotary_kernel(
    q_ptr,  # [T, H, D]
    k_ptr,  # [T, KVH, D]
    cos_ptr,  # [T, R/2] f32
    sin_ptr,  # [T, R/2] f32
    q_weight_ptr,  # [D] (HAS_NORM)
    k_weight_ptr,  # [D] (HAS_NORM)
    v_ptr,  # [T, KVH, D] (WRITE_KV)
    k_cache_ptr,  # [NB, BS, KVH, D] (WRITE_KV)
    v_cache_ptr,  # [NB, BS, KVH, D] (WRITE_KV)
    slot_mapping_ptr,  # [T] (WRITE_KV)
    eps,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_cs_t,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    WRITE_KV: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)  # launched early after the qkv projection (ops/triton_setup.py)
    # program (t, 0): token t's k heads and the cache write; (t, j > 0): its q heads [(j - 1) BH, j BH)
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)
    cs_mask = r < HALF
    # cos/sin rounded to the model dtype first, as `emb.cos().to(q.dtype)` does
    dtype = q_ptr.dtype.element_ty
    c = tl.load(cos_ptr + t * stride_cs_t + r, mask=cs_mask, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_cs_t + r, mask=cs_mask, other=0.0).to(dtype).to(tl.float32)
    if part > 0:
        _norm_rotate_heads(q_ptr, t, (part - 1) * BLOCK_H, stride_q_t, stride_q_h, c, s, q_weight_ptr, eps,
                           NUM_HEADS, HEAD_DIM, HALF, HAS_NORM, BLOCK_H, BLOCK_R, BLOCK_P)  # fmt: skip
    else:
        _norm_rotate_heads(k_ptr, t, 0, stride_k_t, stride_k_h, c, s, k_weight_ptr, eps,
                           NUM_KV_HEADS, HEAD_DIM, HALF, HAS_NORM, BLOCK_KH, BLOCK_R, BLOCK_P)  # fmt: skip
        if WRITE_KV:  # the attention's cache write, in this launch: the rotated k read back once it is stored
            tl.debug_barrier()  # every thread's k stores are visible to the block before the copy reads them
            write_token_kv(t, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                           stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_c_block, stride_c_slot,
                           stride_c_head, NUM_KV_HEADS, HEAD_DIM, CACHE_BLOCK_SIZE, BLOCK_KH, BLOCK_D)  # fmt: skip


def apply_rotary_(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    kv_target: KvTarget | None = None,
) -> None:
    """Triton version of apply_rotary_ref that overwrites q and k (same dtype) in place.

    qk_norm = (q_weight [D], k_weight [D], eps) first applies the per-head RMSNorm (rms_norm_ref) to every
    channel of each head, in the same launch: one kernel for Qwen3's q_norm, k_norm and rotary.
    kv_target = (v, k_cache, v_cache, slot_mapping) then also writes each token's rotated k and its v into
    its cache slot, as ops/kv_cache_write.py's write_kv_cache would (the same stores): the attention's
    own write launch is saved (one per layer; at batch 1 a decode step is a chain of such small launches).
    """
    num_tokens, num_heads, head_dim = q.shape
    half = cos.shape[-1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or k.dtype != q.dtype or 2 * half > head_dim:
        raise ValueError(f"apply_rotary_: q {tuple(q.shape)} / k {tuple(k.shape)} ({q.dtype}, {k.dtype}) do not "
                         f"match each other or cos/sin {tuple(cos.shape)} [T, R/2] with R <= D")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError("apply_rotary_: q, k, cos and sin need a contiguous last dimension")
    if qk_norm is not None and (qk_norm[0].shape != (head_dim,) or qk_norm[1].shape != (head_dim,)):
        raise ValueError(f"apply_rotary_: q/k norm weights {tuple(qk_norm[0].shape)}, {tuple(qk_norm[1].shape)} "
                         f"must be [{head_dim}]")
    if kv_target is not None:
        check_kv_write(k, *kv_target)
    if num_tokens == 0 or (half == 0 and qk_norm is None and kv_target is None):
        return
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)  # weights unread without norm
    v, k_cache, v_cache, slots = kv_target if kv_target is not None else (k, k, k, cos)  # unread without it
    # q heads in groups of up to 8 a program, beside one program for k (at batch 1 one program per token,
    # walking all 32 + 4 heads of Qwen3-30B-A3B, took 3.2 us a layer on the H200)
    block_h = min(triton.next_power_of_2(num_heads), Q_HEADS_PER_PROGRAM)
    early = pdl(q)
    _rotary_kernel[(num_tokens, 1 + triton.cdiv(num_heads, block_h))](
        q, k, cos, sin, q_weight, k_weight, v, k_cache, v_cache, slots, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(-2), cos.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=k.shape[1], HEAD_DIM=head_dim, HALF=half, HAS_NORM=qk_norm is not None,
        BLOCK_H=block_h, BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        BLOCK_R=triton.next_power_of_2(max(half, 1)), BLOCK_P=triton.next_power_of_2(max(head_dim - 2 * half, 1)),
        WRITE_KV=kv_target is not None, CACHE_BLOCK_SIZE=k_cache.shape[1] if kv_target is not None else 1,
        BLOCK_D=triton.next_power_of_2(head_dim), PDL=early, launch_pdl=early,
    )  # fmt: skip
