"""Dense gated MLP (SwiGLU): dense layers of Qwen3-MoE / GLM and GLM's shared experts.

Tensor parallel: gate/up column-parallel, down row-parallel (rank r computes I/N of the intermediate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastdeploy_r3.model_executor.batch_invariant import invariant_rows
from fastdeploy_r3.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    batch_invariant = False  # silu in fixed row tiles on the CPU (model_executor/batch_invariant.py)

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp_rank=tp_rank, tp_size=tp_size)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp_rank=tp_rank, tp_size=tp_size)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, tp_rank=tp_rank, tp_size=tp_size, reduce_results=reduce_results
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> gate, up [T, I/N] -> [T, H] (a partial sum when reduce_results=False)
        return self.down_proj(invariant_rows(F.silu, self.gate_proj(x), self.batch_invariant) * self.up_proj(x))

    def forward_normed(self, x: torch.Tensor, norm: nn.Module,
                       residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(forward(norm(x + residual)), x + residual): the decoder layer's post-attention RMSNorm before this
        MLP, as SparseMoeBlock.forward_normed takes it (which may fuse it into its router gate)."""
        h, total = norm(x, residual)
        return self(h), total
