"""New weights for a running worker, in place: from a checkpoint directory, from a trainer over a
torch.distributed group, or from tensors handed over in memory (`/update_weights_from_tensor`,
offline `LLM.update_weights`).

Every path sends FULL checkpoint tensors under their HF names; each TP rank keeps its own shard
(`MoeCausalLM.load_weights` slices), so the sender never needs to know the engine's parallelism. Under
expert parallelism a rank keeps only its own experts: from disk it does not even read the others';
tensors in the message come without them (the engine splits the message per rank, engine/control.py);
a broadcast delivers them to every rank (every member of a collective receives it), and load_weights
drops them unread.

Order of one update, per rank:

    check every announced name/shape/dtype against the model    (nothing changed yet: a bad update
    disk: read every tensor once more, check values             is refused whole, WeightUpdateError)
    tensors: check every value                                   (model_executor/checkpoint_safety.py)
    receive/read one tensor → check it → copy this rank's shard in   (streamed: one full tensor in memory)

Only the distributed path can fail after the first copy (a trainer that died or stalled
mid-broadcast, a NaN tensor announced as fine): the error says so (`weights_changed`), the group is
torn down (a half-done collective poisons it), and the engine refuses requests until an update
succeeds. Every blocking step (rendezvous, each broadcast) ends at `deadline_s`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from fastdeploy_r3.distributed.weight_update_group import (
    WeightUpdateGroupError,
    destroy_weight_update_group,
    init_weight_update_group,
)
from fastdeploy_r3.model_executor.checkpoint_safety import (
    FLOAT_DTYPES,
    HEADER_DTYPES,
    CheckpointError,
    check_tensor,
    check_tensors,
    iter_checked_safetensors,
    safe_checkpoint_files,
    safetensors_header,
)
from fastdeploy_r3.model_executor.models.base import WeightLoadingError
from fastdeploy_r3.model_executor.quantization.fp8_loading import check_update_dtypes

logger = logging.getLogger(__name__)


class WeightUpdateError(RuntimeError):
    """A weight update failed. weights_changed: some parameters already hold new values."""

    def __init__(self, message: str, weights_changed: bool = False) -> None:
        super().__init__(message)
        self.weights_changed = weights_changed


# float8_e4m3fn: an fp8 engine's weights, sent with their float32 *_scale_inv (quantization/fp8_loading.py)
_FLOAT_NAMES = {"float16", "half", "bfloat16", "float32", "float", "float64", "double", "float8_e4m3fn"}


def torch_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16 (the spellings trainers announce); float types only."""
    short = name.removeprefix("torch.")
    dtype = getattr(torch, short, None) if short in _FLOAT_NAMES else None
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(
            f"dtype {name!r} is not a floating point torch dtype; announce float16, bfloat16, float32 or float64 "
            "(float8_e4m3fn for an fp8 engine's weights, with their scales)"
        )
    return dtype


class WeightUpdater:
    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        tp_rank: int,
        model_dtype: torch.dtype | None = None,
        deadline_s: float = 300.0,
    ) -> None:
        """deadline_s bounds each blocking step of the group path: the rendezvous, each broadcast."""
        self.model = model
        self.device = device
        self.tp_rank = tp_rank
        self.model_dtype = model_dtype or next(model.parameters()).dtype
        self.deadline_s = deadline_s
        self.groups: dict[str, dist.ProcessGroup] = {}

    # -- the trainer's group ------------------------------------------------------------------------

    def init_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        """Join as rank rank_offset + tp_rank; blocks until the trainer and every other rank joined,
        or deadline_s passed (then nothing is left behind)."""
        if group_name in self.groups:
            raise WeightUpdateError(f"weight update group {group_name!r} exists; destroy it first or use another name")
        if backend == "nccl" and self.device.type != "cuda":
            raise WeightUpdateError("backend 'nccl' needs a CUDA engine; this one runs on the CPU, use 'gloo'")
        try:
            self.groups[group_name] = init_weight_update_group(
                master_address, master_port, rank_offset + self.tp_rank, world_size, group_name, backend,
                timeout_s=self.deadline_s,
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
        self._check(dict(zip(names, (tuple(s) for s in shapes))), require_all=False,
                    dtypes=dict(zip(names, torch_dtypes)))
        deadline = timedelta(seconds=self.deadline_s)

        def received() -> Iterator[tuple[str, torch.Tensor]]:
            refused: CheckpointError | None = None
            for name, dtype, shape in zip(names, torch_dtypes, shapes):
                # fp8 travels as its bytes (gloo has no float8 type; NCCL moves the same bytes)
                wire = torch.uint8 if dtype == torch.float8_e4m3fn else dtype
                tensor = torch.empty(tuple(shape), dtype=wire, device=self.device)
                # waited on here with the deadline: a trainer that stalls (or died) fails this call
                dist.broadcast(tensor, src=0, group=group, async_op=True).wait(timeout=deadline)
                tensor = tensor.view(dtype)
                if refused is not None:
                    continue  # keep receiving so that the trainer's broadcasts end and the group stays usable
                try:
                    checked = check_tensor(name, tensor, self.model_dtype)
                except CheckpointError as e:
                    refused = e
                    continue
                yield name, checked
            if refused is not None:
                raise refused

        try:
            return self._load(received(), strict=False, source=f"group {group_name!r}")
        except WeightUpdateError as e:
            if isinstance(e.__cause__, WeightLoadingError):
                raise  # every broadcast was received: the group is still in step with the trainer
            # a collective that failed half way leaves the group unusable: tear it down so that the
            # trainer's next /init_weights_update_group starts clean
            self.groups.pop(group_name, None)
            try:
                destroy_weight_update_group(group)
            except Exception:  # noqa: BLE001 - the group is already broken; dropping it is all we can do
                logger.warning("destroying broken weight update group %r failed", group_name, exc_info=True)
            raise WeightUpdateError(f"{e}; the group {group_name!r} was torn down, initialise it again",
                                    e.weights_changed) from e

    def from_disk(self, model_dir: str) -> int:
        """Load a complete checkpoint directory (config.json + *.safetensors), file by file, after a first
        pass that checks every file, header, dtype and value (checkpoint_safety.py)."""
        try:
            files = safe_checkpoint_files(model_dir)
            header = safetensors_header(files)
            self._check({name: shape for name, (_, shape) in header.items()}, require_all=True,
                        dtypes={name: HEADER_DTYPES[dtype] for name, (dtype, _) in header.items()})
            # every name and shape is checked from the headers; the values read are this rank's only (under
            # expert parallelism another rank's experts are neither read nor checked here: that rank does it)
            for name, tensor in iter_checked_safetensors(files, self.device, self._holds):
                check_tensor(name, tensor, self.model_dtype)
        except CheckpointError as e:
            raise WeightUpdateError(f"weight update refused, no weight changed: {e}") from e
        except OSError as e:  # a file that vanished or cannot be read between the passes
            raise WeightUpdateError(
                f"weight update refused, no weight changed: the checkpoint could not be read ({type(e).__name__})"
            ) from e
        checked = ((name, check_tensor(name, t, self.model_dtype))
                   for name, t in iter_checked_safetensors(files, self.device, self._holds))
        return self._load(checked, strict=True, source="the checkpoint directory")

    def from_tensors(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Full checkpoint tensors handed over in memory (a subset is fine); all checked before any copy."""
        self._check({name: tuple(t.shape) for name, t in named_tensors}, require_all=False,
                    dtypes={name: t.dtype for name, t in named_tensors})
        try:
            checked = check_tensors(named_tensors, self.model_dtype)
        except CheckpointError as e:
            raise WeightUpdateError(f"weight update refused, no weight changed: {e}") from e
        return self._load(iter(checked), strict=False, source="the given tensors")

    def close(self) -> None:
        for name in list(self.groups):
            self.destroy_group(name)

    # -- internals ----------------------------------------------------------------------------------

    def _holds(self, ckpt_name: str) -> bool:
        """False for a routed expert another expert-parallel rank holds (MoeCausalLM.holds_checkpoint_weight)."""
        holds = getattr(self.model, "holds_checkpoint_weight", None)
        return True if holds is None else bool(holds(ckpt_name))

    def _check(
        self, shapes: dict[str, tuple[int, ...]], require_all: bool, dtypes: dict[str, torch.dtype]
    ) -> None:
        try:
            # fp8 only on fp8 layers, weights and scales in pairs (a float weight alone is quantized on arrival)
            check_update_dtypes(dtypes, getattr(self.model, "fp8_weight_names", frozenset()),
                                self.model.checkpoint_weight_shapes())  # type: ignore[operator]
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
        except WeightLoadingError as e:  # our own words: names and shapes, no paths
            raise WeightUpdateError(f"weight update from {source} failed after {count} tensors: {e}",
                                    weights_changed=count > 0) from e
        except Exception as e:
            # a transport's text (gloo, NCCL, safetensors) can carry addresses or file content: the log has it
            logger.exception("weight update from %s failed after %d tensors", source, count)
            raise WeightUpdateError(
                f"weight update from {source} failed after {count} tensors ({type(e).__name__}: the sender "
                "stopped, stalled past the deadline or sent unreadable data; the engine log has the details)",
                weights_changed=count > 0,
            ) from e
        return count


__all__ = ["FLOAT_DTYPES", "WeightUpdateError", "WeightUpdater", "torch_dtype"]
