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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
