"""q, k and v projections as one column-parallel GEMM, loaded from HF's three separate tensors.

Rank r of N holds its heads of each projection side by side (NH, KVH: the model's head counts):

    checkpoint   q_proj.weight [NH * D, H]    k_proj.weight [KVH * D, H]    v_proj.weight [KVH * D, H]
                      │ rows of rank r              │                            │
                      ▼                             ▼                            ▼
    qkv_proj.weight [ q heads of r (NH/N * D) | k heads of r (KVH/N * D) | v heads of r (KVH/N * D) ]  [., H]

so q, k and v come out of one F.linear and split into views without a copy. Biases (qkv_bias) follow
the same layout.
"""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy_r3.model_executor.layers.linear import divide
from fastdeploy_r3.model_executor.quantization import LinearMethod, linear_method

QKV_SHARDS = ("q", "k", "v")


class QKVParallelLinear(nn.Module):
    """x [T, H] -> [T, (NH + 2 * KVH) / N * D]: this rank's q, k, v heads, in that order."""

    batch_invariant = False  # fixed-tile GEMMs (model_executor/batch_invariant.py)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.hidden_size = hidden_size
        self.q_size = divide(num_heads, tp_size, "num_attention_heads") * head_dim
        self.kv_size = divide(num_kv_heads, tp_size, "num_key_value_heads") * head_dim
        out_features = self.q_size + 2 * self.kv_size
        self.quant_method = quant_method or linear_method()
        self.quant_method.create_weights(self, hidden_size, out_features, bias)  # weight [(NH + 2 KVH) / N * D, H]

    @property
    def split_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def _rows(self, shard: str) -> tuple[int, int]:
        """(first row, rows) of `shard`'s part of the merged weight."""
        if shard not in QKV_SHARDS:
            raise ValueError(f"unknown qkv shard {shard!r}; use one of {QKV_SHARDS}")
        index = QKV_SHARDS.index(shard)
        return sum(self.split_sizes[:index]), self.split_sizes[index]

    def checkpoint_shapes(self) -> dict[tuple[str, str], tuple[int, ...]]:
        """{(shard, param): shape of the full checkpoint tensor}, e.g. ('q', 'weight'): (NH * D, H)."""
        shapes: dict[tuple[str, str], tuple[int, ...]] = {}
        for shard in QKV_SHARDS:
            rows = self._rows(shard)[1] * self.tp_size
            shapes[(shard, "weight")] = (rows, self.hidden_size)
            if self.bias is not None:
                shapes[(shard, "bias")] = (rows,)
        return shapes

    def shard(self, shard: str, param_name: str = "weight") -> torch.Tensor:
        """This rank's rows of `shard` (a view of the merged parameter)."""
        first, rows = self._rows(shard)
        return getattr(self, param_name).narrow(0, first, rows)

    def load_shard(self, shard: str, param_name: str, full: torch.Tensor) -> None:
        """Copy this rank's slice of the full checkpoint tensor q_proj / k_proj / v_proj into place."""
        dst = self.shard(shard, param_name)
        rows = dst.shape[0]
        dst.copy_(full.narrow(0, self.tp_rank * rows, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)  # [T, (NH + 2 KVH) / N * D]

    def forward_normed(self, x: torch.Tensor, norm: nn.Module,
                       residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(this projection of norm(x + residual), x + residual): the RMSNorm before it, which the quant
        method may fuse into its GEMM (LinearMethod.apply_normed)."""
        return self.quant_method.apply_normed(self, x, norm, residual, self.bias)
