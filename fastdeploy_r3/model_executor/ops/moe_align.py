"""Token -> expert sorting on the device, with no host synchronisation (graph-safe).

Shape legend: T = tokens, K = experts per token, N = T * K routed rows ("flat row" n = t * K + k),
E = experts, BM = block of rows one Triton program multiplies, P = padded rows, NB = P / BM blocks.

Two layouts, one per fused-MoE backend:

    sort_by_expert        order [N]: flat rows grouped by expert (stable), offsets [E]: end of each
                          expert's group (torch._grouped_mm's `offs`).
    align_to_blocks       each expert's group padded to a multiple of BM so that every block of BM
                          rows belongs to one expert (the Triton kernels):

        topk_ids = [[2, 0], [2, 1]]  (T=2, K=2), BM = 4
        sorted_ids   = [1, N, N, N | 3, N, N, N | 0, 2, N, N | N, N, N, N]   (N = 4: a padding row)
        block_expert = [0, 1, 2, 2]        num_padded = [12]   (the last block is past it: skipped)

Counts come from scatter_add_, never bincount (which reads its size back to the host), and every
output has a size that depends only on (T, K, E, BM), so a CUDA graph can hold these ops.

On CUDA, batches of up to ALIGN_KERNEL_MAX_ROWS rows (decode) take `_align_kernel`: the same layout in
ONE launch instead of ~25 small torch kernels, which at batch 1 cost more than the expert GEMMs. It
places the rows of an expert with atomics, so their order inside the expert's blocks may vary from run
to run; the GEMMs compute each row on its own and write it back by flat row, so the MoE output does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdeploy_r3.model_executor.ops.triton_setup import jit, require_triton, tl, triton, use_triton

ALIGN_KERNEL_MAX_ROWS = 4096  # one program holds every row: decode batches, not prefill chunks


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """topk_ids [T, K] -> rows routed to each expert [E] int64 (device-side, no sync)."""
    flat = topk_ids.reshape(-1).long()  # [N]
    return torch.zeros(num_experts, dtype=torch.int64, device=topk_ids.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] -> (order [N] int64 flat rows by expert, offsets [E] int32 cumulative counts)."""
    flat = topk_ids.reshape(-1)  # [N]
    order = torch.argsort(flat, stable=True)  # [N]
    offsets = torch.cumsum(expert_counts(topk_ids, num_experts), 0).to(torch.int32)  # [E]
    return order, offsets


@dataclass
class MoeBlocks:
    sorted_ids: torch.Tensor  # [P] int32 flat rows, expert-major, N where a block is padded
    block_expert: torch.Tensor  # [NB] int32 expert of each block (blocks past num_padded are skipped)
    num_padded: torch.Tensor  # [1] int32 rows in use (a multiple of BM)
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """Worst case of sum_e ceil(count_e / BM) * BM: at most min(E, N) experts carry a partial block."""
    nonempty = min(num_experts, num_rows)
    return -(-(num_rows + nonempty * (block_m - 1)) // block_m) * block_m


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeBlocks:
    """topk_ids [T, K] -> MoeBlocks: rows grouped by expert, each group padded to a multiple of block_m."""
    num_rows = topk_ids.numel()
    if use_triton(topk_ids) and 0 < num_rows <= ALIGN_KERNEL_MAX_ROWS:
        return align_to_blocks_triton(topk_ids, num_experts, block_m)
    return align_to_blocks_torch(topk_ids, num_experts, block_m)


def align_to_blocks_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeBlocks:
    """The reference of align_to_blocks in torch ops (stable: rows of an expert in flat-row order)."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [N]
    num_rows = flat.shape[0]
    counts = expert_counts(topk_ids, num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    group_start = torch.cumsum(counts, 0) - counts  # [E] start of each expert's group among sorted rows
    order = torch.argsort(flat, stable=True)  # [N] flat rows by expert
    sorted_expert = flat[order]  # [N]
    rank = torch.arange(num_rows, device=dev) - group_start[sorted_expert]  # [N] index inside the group
    dest = padded_end[sorted_expert] - padded[sorted_expert] + rank  # [N] position in the padded layout
    total = max_padded_rows(num_rows, num_experts, block_m)
    sorted_ids = torch.full((total,), num_rows, dtype=torch.int64, device=dev).scatter_(0, dest, order)  # [P]
    block_start = torch.arange(0, total, block_m, device=dev)  # [NB]
    block_expert = torch.searchsorted(padded_end, block_start, right=True).clamp_(max=num_experts - 1)  # [NB]
    return MoeBlocks(
        sorted_ids=sorted_ids.to(torch.int32),
        block_expert=block_expert.to(torch.int32),
        num_padded=padded_end[-1:].to(torch.int32),
        block_m=block_m,
    )


@jit
def align_tail(
    ids_ptr,  # [N] flat expert ids, contiguous
    counts,  # [BINS] int32 rows of each expert (bins >= E are ignored)
    sorted_ids_ptr,  # [P] int32
    block_expert_ptr,  # [NB] int32
    num_padded_ptr,  # [1] int32
    cursor_ptr,  # [BINS] int32 scratch: next free position of each expert
    num_rows,  # N
    num_experts,  # E
    total_rows,  # P
    num_blocks,  # NB
    BLOCK_M: tl.constexpr,
    BINS: tl.constexpr,  # power of two >= E
):
    """The layout of align_to_blocks from per-expert counts, in the calling program (any N: chunked loops).
    Shared by _align_kernel and the fused routing kernel (ops/fused_routing.py)."""
    e = tl.arange(0, BINS)  # [BINS]
    counts = tl.where(e < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [BINS]
    end = tl.cumsum(padded, 0)  # [BINS]
    tl.store(cursor_ptr + e, end - padded)
    for p0 in range(0, total_rows, 1024):
        p = p0 + tl.arange(0, 1024)
        tl.store(sorted_ids_ptr + p, tl.full((1024,), 0, tl.int32) + num_rows, mask=p < total_rows)
    for b0 in range(0, num_blocks, 64):
        b = b0 + tl.arange(0, 64)  # [64]
        before = (end[None, :] <= (b * BLOCK_M)[:, None]) & (e[None, :] < num_experts)  # [64, BINS]
        expert = tl.minimum(tl.sum(before.to(tl.int32), axis=1), num_experts - 1)  # [64]
        tl.store(block_expert_ptr + b, expert, mask=b < num_blocks)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    tl.debug_barrier()  # padding and cursors in place before any row claims its position
    for n0 in range(0, num_rows, 1024):
        n = n0 + tl.arange(0, 1024)  # [1024]
        valid = n < num_rows
        ids = tl.load(ids_ptr + n, mask=valid, other=0).to(tl.int32)  # [1024]
        pos = tl.atomic_add(cursor_ptr + ids, 1, mask=valid)  # distinct positions within each expert
        tl.store(sorted_ids_ptr + pos, n, mask=valid)


@jit
def _align_kernel(
    topk_ids_ptr,  # [N] flat, contiguous
    sorted_ids_ptr,  # [P] int32
    block_expert_ptr,  # [NB] int32
    num_padded_ptr,  # [1] int32
    cursor_ptr,  # [BINS] int32 scratch: next free position of each expert
    num_rows,  # N
    num_experts,  # E
    total_rows,  # P
    num_blocks,  # NB
    BLOCK_M: tl.constexpr,
    BINS: tl.constexpr,  # power of two > E: the last bin takes the lanes past N
    ROWS: tl.constexpr,  # power of two >= N
):
    n = tl.arange(0, ROWS)  # [ROWS]
    ids = tl.load(topk_ids_ptr + n, mask=n < num_rows, other=BINS - 1).to(tl.int32)  # [ROWS]
    counts = tl.histogram(ids, BINS)  # [BINS]
    align_tail(topk_ids_ptr, counts, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, cursor_ptr,
               num_rows, num_experts, total_rows, num_blocks, BLOCK_M, BINS)


def align_to_blocks_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeBlocks:
    """align_to_blocks in one Triton launch (N <= ALIGN_KERNEL_MAX_ROWS); no host sync."""
    require_triton("align_to_blocks_triton")
    num_rows = topk_ids.numel()
    if not 0 < num_rows <= ALIGN_KERNEL_MAX_ROWS:
        raise ValueError(f"align_to_blocks_triton: {num_rows} rows; the kernel takes 1..{ALIGN_KERNEL_MAX_ROWS}")
    dev = topk_ids.device
    total = max_padded_rows(num_rows, num_experts, block_m)
    num_blocks = total // block_m
    bins = triton.next_power_of_2(num_experts + 1)
    sorted_ids = torch.empty(total, dtype=torch.int32, device=dev)  # [P]
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)  # [NB]
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    cursor = torch.empty(bins, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](
        topk_ids.contiguous(), sorted_ids, block_expert, num_padded, cursor,
        num_rows, num_experts, total, num_blocks,
        BLOCK_M=block_m, BINS=bins, ROWS=triton.next_power_of_2(num_rows), num_warps=8,
    )
    return MoeBlocks(sorted_ids=sorted_ids, block_expert=block_expert, num_padded=num_padded, block_m=block_m)
