"""Write a step's k/v into their slots of the paged KV cache: one Triton launch for both caches.

    k, v:              [T, KVH, D]      (any strides whose last dim is contiguous: views of the qkv output)
    k_cache, v_cache:  [NB, BS, KVH, D]
    slot_mapping:      [T]  slot = block_id * BS + offset; < 0 marks a padded token, which writes nothing

The torch reference (`write_kv_cache_ref`) is what TorchPagedAttentionBackend does.
"""

from __future__ import annotations

import torch

from fastdeploy_r3.model_executor.ops.triton_setup import jit, tl, triton


def write_kv_cache_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k_cache.flat[slot] = k[t] (cast) for every t with slot_mapping[t] >= 0; same for v."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.to(k_cache.device)  # [T]
    keep = slots >= 0
    if not bool(keep.all()):  # padded tokens (CPU path only: boolean indexing syncs on CUDA)
        slots, k, v = slots[keep], k[keep], v[keep]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k.to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v.to(v_cache.dtype)


@jit
def write_token_kv(
    t, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_c_block, stride_c_slot, stride_c_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Token t's k and v heads into its slot of both caches (nothing for a slot < 0); shared with the
    rotary kernel (ops/rotary.py), which writes the rotated k this way in its own launch."""
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
        d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
        dst = (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_slot
        dst_offs = dst + h[:, None] * stride_c_head + d[None, :]  # [BLOCK_H, BLOCK_D]
        k = tl.load(k_ptr + t * stride_k_t + h[:, None] * stride_k_h + d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_v_t + h[:, None] * stride_v_h + d[None, :], mask=mask)
        tl.store(k_cache_ptr + dst_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@jit
def _write_kv_cache_kernel(
    k_ptr,  # [T, KVH, D]
    v_ptr,  # [T, KVH, D]
    k_cache_ptr,  # [NB, BS, KVH, D]
    v_cache_ptr,  # [NB, BS, KVH, D]
    slot_mapping_ptr,  # [T]
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # one program per token
    write_token_kv(t, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                   stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_c_block, stride_c_slot, stride_c_head,
                   NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_H, BLOCK_D)  # fmt: skip


def check_kv_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The shapes and strides write_kv_cache (and the rotary kernel's fused write) take, or a ValueError."""
    num_tokens, num_kv_heads, head_dim = k.shape
    _, _, cache_kv_heads, cache_head_dim = k_cache.shape
    if (cache_kv_heads, cache_head_dim) != (num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"write_kv_cache: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit a cache of "
            f"{tuple(k_cache.shape)} [NB, BS, KVH, D]"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("write_kv_cache: k, v and both caches need a contiguous last (head_dim) dimension, "
                         "and the two caches the same strides")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"write_kv_cache: slot_mapping {tuple(slot_mapping.shape)} must be [{num_tokens}]")


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton version of write_kv_cache_ref; no host sync, so a CUDA graph may record it."""
    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    block_size = k_cache.shape[1]
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
