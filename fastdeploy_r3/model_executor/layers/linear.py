"""Tensor-parallel linear layers (Megatron split). Each holds its rank's shard and loads it from the
full checkpoint tensor, so the module tree and parameter names stay those of the HF checkpoint.

    column-parallel  W [O, I]: rank r holds rows    [r*O/N, (r+1)*O/N)  -> y_r = x W_r^T   (a slice of y)
    row-parallel     W [O, I]: rank r holds columns [r*I/N, (r+1)*I/N)  -> y = sum_r x_r W_r^T (all-reduce)

A column-parallel layer followed by a row-parallel one (q/k/v -> o, gate/up -> down) needs one
all-reduce and no gather: the slice y_r is exactly the x_r the next layer's shard wants.
"""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy_r3.config import ConfigError
from fastdeploy_r3.distributed.parallel_state import all_reduce
from fastdeploy_r3.model_executor.quantization import LinearMethod, linear_method


def divide(total: int, tp_size: int, what: str) -> int:
    if total % tp_size:
        raise ConfigError(f"{what}={total} is not divisible by tensor_parallel_size={tp_size}")
    return total // tp_size


class ShardedLinear(nn.Module):
    """A linear layer holding one rank's shard: weight on `shard_dim`, bias as `bias_shard_dim` says.

    Its parameters are created, and its GEMM run, by `quant_method` (model_executor/quantization/)."""

    shard_dim: int  # of the weight [O, I]: 0 = column-parallel, 1 = row-parallel
    bias_shard_dim: int | None  # None: the bias is replicated
    batch_invariant = False  # fixed-tile GEMMs (model_executor/batch_invariant.py)

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int, tp_size: int,
                 quant_method: LinearMethod | None = None) -> None:  # fmt: skip
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.quant_method = quant_method or linear_method()
        self.quant_method.create_weights(self, in_features, out_features, bias)  # weight [O_local, I_local]

    def _param_shard_dim(self, param_name: str) -> int | None:
        # an fp8 layer's weight_scale_inv (rows expanded, quantization/fp8.py) is cut like its weight
        return self.shard_dim if param_name in ("weight", "weight_scale_inv") else self.bias_shard_dim

    def full_shape(self, param_name: str) -> tuple[int, ...]:
        """Shape of the checkpoint tensor `param_name` is a shard of."""
        shape = list(getattr(self, param_name).shape)
        dim = self._param_shard_dim(param_name)
        if dim is not None:
            shape[dim] *= self.tp_size
        return tuple(shape)

    def load_shard(self, param_name: str, full: torch.Tensor) -> None:
        """Copy this rank's slice of the full checkpoint tensor into `param_name`."""
        param = getattr(self, param_name)
        dim = self._param_shard_dim(param_name)
        if dim is None:
            param.copy_(full)
        else:
            size = param.shape[dim]
            param.copy_(full.narrow(dim, self.tp_rank * size, size))


class ColumnParallelLinear(ShardedLinear):
    """x [T, I] (replicated) -> [T, O / N], this rank's slice of the output features."""

    shard_dim = 0
    bias_shard_dim = 0

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1,
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__(in_features, divide(out_features, tp_size, "output features"), bias, tp_rank, tp_size,
                         quant_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)  # [T, O / N]


class RowParallelLinear(ShardedLinear):
    """x [T, I / N] (this rank's slice) -> [T, O], summed over ranks unless reduce_results=False.

    reduce_results=False hands back the partial sum so a caller can add several partials first and
    reduce once (the MoE block: routed experts + shared experts, one all-reduce).
    """

    shard_dim = 1
    bias_shard_dim = None  # added once, after the reduction

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        reduce_results: bool = True,
        quant_method: LinearMethod | None = None,
    ) -> None:
        if bias and not reduce_results:
            raise ValueError("a row-parallel bias needs reduce_results=True (it must be added exactly once)")
        super().__init__(divide(in_features, tp_size, "input features"), out_features, bias, tp_rank, tp_size,
                         quant_method)
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)  # [T, O], unquantized: nn.Linear's kernel
        y = self.quant_method.apply(self, x, None)  # [T, O], this rank's partial sum
        if not self.reduce_results:
            return y
        y = all_reduce(y)  # [T, O]
        return y if self.bias is None else y + self.bias
