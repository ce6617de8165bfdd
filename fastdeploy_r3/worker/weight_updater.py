"""New weights for a running worker, in place: from a checkpoint directory, from a trainer over a
torch.distributed group, or from tensors handed over by the engine (offline `LLM.update_weights`).

Every path sends FULL checkpoint tensors under their HF names; each TP rank keeps its own shard
(`MoeCausalLM.load_weights` slices), so the sender never needs to know the engine's parallelism.

Order of one update, per rank:

    check every announced name/shape against the model     (nothing changed yet: a bad update is
                                                             refused whole, WeightUpdateError)
    receive/read one tensor → copy this rank's shard in     (streamed: one full tensor in memory)

A failure after the first copy (a trainer that died mid-broadcast, a truncated file) leaves a mix of
old and new weights; the error says so (`weights_changed`) and the engine refuses requests until an
update succeeds.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from fastdeploy_r3.distributed.weight_update_group import (
    WeightUpdateGroupError,
    destroy_weight_update_group,
    init_weight_update_group,
)
from fastdeploy_r3.model_executor.model_loader import iter_safetensors, safetensors_files, safetensors_shapes
from fastdeploy_r3.model_executor.models.base import WeightLoadingError


class WeightUpdateError(RuntimeError):
    """A weight update failed. weights_changed: some parameters already hold new values."""

    def __init__(self, message: str, weights_changed: bool = False) -> None:
        super().__init__(message)
        self.weights_changed = weights_changed


def torch_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16 (the spellings trainers announce)."""
    short = name.removeprefix("torch.")
    dtype = getattr(torch, short, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"dtype {name!r} is not a torch dtype; announce e.g. 'bfloat16' or 'float32'")
    return dtype


class WeightUpdater:
    def __init__(self, model: nn.Module, device: torch.device, tp_rank: int) -> None:
        self.model = model
        self.device = device
        self.tp_rank = tp_rank
        self.groups: dict[str, dist.ProcessGroup] = {}

    # -- the trainer's group ------------------------------------------------------------------------

    def init_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        """Join as rank rank_offset + tp_rank; blocks until the trainer and every other rank joined."""
        if group_name in self.groups:
            raise WeightUpdateError(f"weight update group {group_name!r} exists; destroy it first or use another name")
        if backend == "nccl" and self.device.type != "cuda":
            raise WeightUpdateError("backend 'nccl' needs a CUDA engine; this one runs on the CPU, use 'gloo'")
        try:
            self.groups[group_name] = init_weight_update_group(
                master_address, master_port, rank_offset + self.tp_rank, world_size, group_name, backend
            )
        except WeightUpdateGroupError as e:
            raise WeightUpdateError(str(e)) from e

    def destroy_group(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise WeightUpdateError(f"no weight update group {group_name!r}; known: {sorted(self.groups) or 'none'}")
        destroy_weight_update_group(group)

    # -- updates ------------------------------------------------------------------------------------

    def from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str) -> int:
        """Receive len(names) tensors broadcast by the trainer (group rank 0), in the announced order."""
        if not len(names) == len(dtypes) == len(shapes):
            raise WeightUpdateError(
                f"announced {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes; "
                "send one of each per tensor"
            )
        group = self.groups.get(group_name)
        if group is None:
            raise WeightUpdateError(
                f"no weight update group {group_name!r}; call /init_weights_update_group first "
                f"(known: {sorted(self.groups) or 'none'})"
            )
        torch_dtypes = [torch_dtype(d) for d in dtypes]
        self._check(dict(zip(names, (tuple(s) for s in shapes))), require_all=False)

        def received() -> Iterator[tuple[str, torch.Tensor]]:
            for name, dtype, shape in zip(names, torch_dtypes, shapes):
                tensor = torch.empty(tuple(shape), dtype=dtype, device=self.device)
                dist.broadcast(tensor, src=0, group=group)
                yield name, tensor

        return self._load(received(), strict=False, source=f"group {group_name!r}")

    def from_disk(self, model_dir: str) -> int:
        """Load a complete checkpoint directory (config.json + *.safetensors), file by file."""
        if not os.path.isdir(model_dir):
            raise WeightUpdateError(f"model_path {model_dir!r} is not a directory on the engine's machine")
        try:
            files = safetensors_files(model_dir)
            shapes = safetensors_shapes(files)
        except (WeightLoadingError, OSError) as e:
            raise WeightUpdateError(f"cannot read the checkpoint in {model_dir!r}: {e}") from e
        self._check(shapes, require_all=True)
        return self._load(iter_safetensors(files, self.device), strict=True, source=model_dir)

    def from_tensors(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Full checkpoint tensors handed over in memory (a subset is fine)."""
        self._check({name: tuple(t.shape) for name, t in named_tensors}, require_all=False)
        return self._load(iter(named_tensors), strict=False, source="the given tensors")

    def close(self) -> None:
        for name in list(self.groups):
            self.destroy_group(name)

    # -- internals ----------------------------------------------------------------------------------

    def _check(self, shapes: dict[str, tuple[int, ...]], require_all: bool) -> None:
        try:
            self.model.check_checkpoint_weights(shapes, require_all=require_all)  # type: ignore[operator]
        except WeightLoadingError as e:
            raise WeightUpdateError(f"weight update refused, no weight changed: {e}") from e

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool, source: str) -> int:
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in weights:
                yield item
                count += 1

        try:
            self.model.load_weights(counted(), strict=strict)  # type: ignore[operator]
        except Exception as e:
            raise WeightUpdateError(
                f"weight update from {source} failed after {count} tensors: {type(e).__name__}: {e}",
                weights_changed=count > 0,
            ) from e
        return count
