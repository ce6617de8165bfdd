"""Triton kernels of the R3 capture path, each beside its pure-torch reference.

Shape legend: T = tokens in the step (maybe padded for a CUDA graph), L = MoE layers, K = experts per
token, S = slots of the host buffer.

    every MoE layer:  topk_ids [T, K] ──capture_topk_ids──► step buffer[:T, moe_index, :]
    once per step:    step buffer[:T] [T, L, K] ──scatter_rows_to_host──► host_rows[slot_mapping]  (rank 0)
                      tags [T]                                         ──► host_tags[slot_mapping]

Dtypes. The kernels cast on store to whatever the destination holds (uint8 / uint16 / int32). The
step buffer that `RoutingCapture` owns is int32 on every device: torch supports uint16 only partly
(no index_put, no CPU max), and the buffer is small (8192 tokens x 45 layers x 8 = 12 MB). The
narrowing to the routing dtype happens once, on the way out: in `scatter_rows_to_host` on GPU, in a
numpy `astype` on CPU.

Which path runs: `capture_topk_ids_dispatch` asks ops/triton_setup.py's `use_triton`, the rule every
kernel follows (CUDA tensors, or CPU tensors under TRITON_INTERPRET); otherwise the torch reference.
"""

from __future__ import annotations

from typing import Protocol

import torch

from fastdeploy_r3.model_executor.ops.triton_setup import jit, require_triton, tl, triton, use_triton


class PointerLike(Protocol):
    """What a Triton launch accepts as a pointer: a cudaHostRegister'ed SHM array qualifies (§5.2)."""

    dtype: torch.dtype

    def data_ptr(self) -> int: ...


@jit
def _capture_topk_ids_kernel(
    buffer_ptr,  # [max_tokens, L, K]
    topk_ids_ptr,  # [T, K]
    num_tokens_ptr,  # [1] int, read only when HAS_NUM_TOKENS
    num_rows,  # T (the launch size; a CUDA graph bakes it in)
    moe_index,
    stride_buf_t,
    stride_buf_l,
    stride_ids_t,
    stride_ids_k,
    K: tl.constexpr,
    HAS_NUM_TOKENS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    limit = num_rows
    if HAS_NUM_TOKENS:
        # The real count lives on the device so that a replayed graph needs no host sync; padded rows
        # beyond it keep whatever they held.
        limit = tl.minimum(tl.load(num_tokens_ptr).to(tl.int64), num_rows)
    mask = (t[:, None] < limit) & (k[None, :] < K)  # [BLOCK_T, BLOCK_K]
    t64 = t.to(tl.int64)
    ids = tl.load(topk_ids_ptr + t64[:, None] * stride_ids_t + k[None, :] * stride_ids_k, mask=mask)
    dst = buffer_ptr + t64[:, None] * stride_buf_t + moe_index * stride_buf_l + k[None, :]
    tl.store(dst, ids.to(buffer_ptr.dtype.element_ty), mask=mask)


@jit
def _scatter_rows_to_host_kernel(
    step_rows_ptr,  # [T, L, K] contiguous rows
    slot_mapping_ptr,  # [T] int, < 0 = padded token
    tags_ptr,  # [T] int64
    host_rows_ptr,  # [S, L, K] contiguous
    host_tags_ptr,  # [S] int64
    num_tokens_ptr,  # [1] int, read only when HAS_NUM_TOKENS
    num_rows,
    stride_step_t,
    ROW: tl.constexpr,  # L * K
    HAS_NUM_TOKENS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)  # one program per token row
    limit = num_rows
    if HAS_NUM_TOKENS:
        limit = tl.minimum(tl.load(num_tokens_ptr).to(tl.int64), num_rows)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if (t < limit) & (slot >= 0):
        offs = tl.arange(0, BLOCK)  # [BLOCK]
        mask = offs < ROW
        vals = tl.load(step_rows_ptr + t.to(tl.int64) * stride_step_t + offs, mask=mask)
        tl.store(host_rows_ptr + slot * ROW + offs, vals.to(host_rows_ptr.dtype.element_ty), mask=mask)
        tl.store(host_tags_ptr + slot, tl.load(tags_ptr + t))


def _check_capture_args(buffer: torch.Tensor, moe_index: int, topk_ids: torch.Tensor) -> None:
    if buffer.dim() != 3 or topk_ids.dim() != 2 or topk_ids.shape[1] != buffer.shape[2]:
        raise ValueError(f"capture_topk_ids: buffer {tuple(buffer.shape)} is not [max_tokens, L, K] "
                         f"for topk_ids {tuple(topk_ids.shape)} [T, K]")
    if not 0 <= moe_index < buffer.shape[1]:
        raise ValueError(f"capture_topk_ids: moe_index {moe_index} is outside [0, {buffer.shape[1]})")
    if topk_ids.shape[0] > buffer.shape[0]:
        raise ValueError(f"capture_topk_ids: {topk_ids.shape[0]} tokens exceed the buffer's {buffer.shape[0]} rows")


def capture_topk_ids_ref(
    buffer: torch.Tensor, moe_index: int, topk_ids: torch.Tensor, num_tokens: torch.Tensor | None = None
) -> None:
    """buffer[:T, moe_index, :] = topk_ids, cast to buffer.dtype; rows >= num_tokens untouched."""
    _check_capture_args(buffer, moe_index, topk_ids)
    n = topk_ids.shape[0] if num_tokens is None else min(int(num_tokens.reshape(-1)[0]), topk_ids.shape[0])
    buffer[:n, moe_index, :].copy_(topk_ids[:n])  # [n, K]; copy_ casts


def capture_topk_ids(
    buffer: torch.Tensor, moe_index: int, topk_ids: torch.Tensor, num_tokens: torch.Tensor | None = None
) -> None:
    """Triton version of capture_topk_ids_ref: no host sync, so it may be recorded in a CUDA graph."""
    require_triton("capture_topk_ids")
    _check_capture_args(buffer, moe_index, topk_ids)
    if buffer.stride(2) != 1:
        raise ValueError("capture_topk_ids: the buffer's last dimension must be contiguous")
    T, K = topk_ids.shape
    if T == 0:
        return
    block_t = 64
    _capture_topk_ids_kernel[(triton.cdiv(T, block_t),)](
        buffer, topk_ids, topk_ids if num_tokens is None else num_tokens, T, moe_index,
        buffer.stride(0), buffer.stride(1), topk_ids.stride(0), topk_ids.stride(1),
        K=K, HAS_NUM_TOKENS=num_tokens is not None, BLOCK_T=block_t, BLOCK_K=triton.next_power_of_2(K),
    )


def capture_topk_ids_dispatch(
    buffer: torch.Tensor, moe_index: int, topk_ids: torch.Tensor, num_tokens: torch.Tensor | None = None
) -> None:
    """The Triton kernel on CUDA (or under the interpreter), the torch reference on the CPU serving path."""
    if use_triton(buffer):
        capture_topk_ids(buffer, moe_index, topk_ids, num_tokens)
    else:
        capture_topk_ids_ref(buffer, moe_index, topk_ids, num_tokens)


def scatter_rows_to_host(
    step_rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    tags: torch.Tensor,
    host_rows: torch.Tensor | PointerLike,
    host_tags: torch.Tensor | PointerLike,
    num_tokens: torch.Tensor | None = None,
) -> None:
    """host_rows[slot_mapping[t]] = step_rows[t] (cast) and host_tags[slot_mapping[t]] = tags[t].

    step_rows [T, L, K] (a view of the step buffer, rows contiguous), slot_mapping [T] (< 0 skips a
    padded token), tags [T] int64. host_rows [S, L, K] / host_tags [S] int64 are the SHM routing_host_buffer,
    on GPU passed as its mapped address (cudaHostRegister: device pointer == host pointer, §5.2), so
    that no D2H copy or CPU scatter sits on the step. The caller guarantees every slot < S.
    Reference: RoutingBuffer.write (the CPU path).
    """
    require_triton("scatter_rows_to_host")
    T, L, K = step_rows.shape
    if step_rows.stride(2) != 1 or step_rows.stride(1) != K:
        raise ValueError("scatter_rows_to_host: each row of step_rows must be contiguous [L, K]")
    if slot_mapping.shape != (T,) or tags.shape != (T,):
        raise ValueError(f"scatter_rows_to_host: slot_mapping {tuple(slot_mapping.shape)} and tags "
                         f"{tuple(tags.shape)} must be [{T}]")
    if T == 0:
        return
    _scatter_rows_to_host_kernel[(T,)](
        step_rows, slot_mapping, tags, host_rows, host_tags,
        slot_mapping if num_tokens is None else num_tokens, T, step_rows.stride(0),
        ROW=L * K, HAS_NUM_TOKENS=num_tokens is not None, BLOCK=triton.next_power_of_2(L * K),
    )
