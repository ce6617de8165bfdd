"""Named tensors handed to a worker by reference (SGLang's `/update_weights_from_tensor`): the
receiving half of `MultiprocessingSerializer`.

    trainer (same machine)                         worker rank r
    ForkingPickler([(name, tensor), ...])  ──►     restricted unpickle of payload[r]
      CUDA tensor → cudaIpcMemHandle                 → rebuild_cuda_tensor: the trainer's memory,
      CPU tensor  → shared-memory file name            mapped (no copy through the host)
    base64 text in the JSON body                     → copied into this rank's shard by load_weights

Formats (SGLang's `load_format`): None / "direct" — a list of (name, tensor), a tensor possibly wrapped
in LocalSerializedTensor (one payload per rank inside); "flattened_bucket" — {"flattened_tensor",
"metadata": [FlattenedTensorMetadata]}, one byte buffer holding many tensors (slime's colocated path).

A pickle can run any callable it names, so the payload is unpickled with an allow-list: torch's
own tensor/storage rebuild functions, dtypes, and the two SGLang classes (mapped onto the ones here).
Anything else is refused with `TensorTransportError`.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch

LOAD_FORMATS = (None, "direct", "flattened_bucket")
_TORCH_REBUILDS = {
    "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child",
    "rebuild_storage_filename", "rebuild_storage_fd", "rebuild_storage_empty",
}


class TensorTransportError(ValueError):
    """A serialized tensor payload cannot be used; the message says what is wrong with it."""


@dataclass
class FlattenedTensorMetadata:
    """One tensor's place in a flattened bucket (SGLang's sglang.srt.weight_sync.tensor_bucket class)."""

    name: str
    shape: Any  # torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class LocalSerializedTensor:
    """One payload per TP rank around a single tensor (SGLang's class of the same name)."""

    values: list[bytes]


_MAPPED = {"FlattenedTensorMetadata": FlattenedTensorMetadata, "LocalSerializedTensor": LocalSerializedTensor}


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.multiprocessing.reductions" and name in _TORCH_REBUILDS:
            return getattr(__import__(module, fromlist=[name]), name)
        if module == "torch" and name in ("Tensor", "Size", "device"):
            return getattr(torch, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch.storage" and name in ("UntypedStorage", "TypedStorage"):
            return getattr(torch.storage, name)
        if module == "torch.nn.parameter" and name == "Parameter":
            return torch.nn.Parameter
        if module == "multiprocessing.resource_sharer" and name == "DupFd":
            from multiprocessing.resource_sharer import DupFd

            return DupFd
        if module.split(".")[0] in ("sglang", "fastdeploy_r3") and name in _MAPPED:
            return _MAPPED[name]
        raise TensorTransportError(
            f"serialized_named_tensors references {module}.{name}, which a tensor payload never needs; send "
            "what MultiprocessingSerializer.serialize writes for a list of (name, tensor)"
        )


def _unpickle(data: str | bytes) -> Any:
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise TensorTransportError("serialized_named_tensors entries must be base64 text") from None
    try:
        return _AllowListUnpickler(io.BytesIO(data)).load()
    except TensorTransportError:
        raise
    except Exception as e:  # noqa: BLE001 - the unpickler's text can quote the payload
        raise TensorTransportError(
            f"a serialized_named_tensors entry could not be opened ({type(e).__name__}); it must come from "
            "MultiprocessingSerializer on this machine, from a process that is still alive and holds the tensors"
        ) from None


def deserialize_named_tensors(
    data: str | bytes, load_format: str | None, tp_rank: int, device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """This rank's payload -> [(HF name, tensor)], tensors on their owner's device (not copied)."""
    if load_format not in LOAD_FORMATS:
        raise TensorTransportError(
            f"load_format {load_format!r} is not supported for tensors; use null, 'direct' or 'flattened_bucket'"
        )
    obj = _unpickle(data)
    if load_format == "flattened_bucket":
        return _reconstruct_bucket(obj)
    if not isinstance(obj, (list, tuple)):
        raise TensorTransportError("a 'direct' payload must be a list of (name, tensor) pairs")
    out = []
    for item in obj:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
            raise TensorTransportError("a 'direct' payload must be a list of (name, tensor) pairs")
        name, tensor = item
        if isinstance(tensor, LocalSerializedTensor):
            if not 0 <= tp_rank < len(tensor.values):
                raise TensorTransportError(f"LocalSerializedTensor {name!r} has no value for TP rank {tp_rank}")
            tensor = _unpickle(tensor.values[tp_rank])
        out.append((name, _as_tensor(name, tensor)))
    return out


def _reconstruct_bucket(obj: Any) -> list[tuple[str, torch.Tensor]]:
    if not (isinstance(obj, dict) and {"flattened_tensor", "metadata"} <= set(obj)):
        raise TensorTransportError("a 'flattened_bucket' payload must be {'flattened_tensor', 'metadata'}")
    flat = _as_tensor("flattened_tensor", obj["flattened_tensor"]).reshape(-1)
    out = []
    for meta in obj["metadata"]:
        if not isinstance(meta, FlattenedTensorMetadata):
            raise TensorTransportError("flattened_bucket metadata entries must be FlattenedTensorMetadata")
        if not 0 <= meta.start_idx <= meta.end_idx <= flat.numel():
            raise TensorTransportError(f"tensor {meta.name!r} lies outside the flattened bucket")
        part = flat[meta.start_idx:meta.end_idx]
        try:
            # SGLang's bucket is raw bytes (uint8) viewed back in each tensor's dtype; older buckets held one
            # float dtype and converted
            part = part.view(meta.dtype) if flat.dtype == torch.uint8 else part.to(meta.dtype)
            out.append((meta.name, part.reshape(tuple(meta.shape))))
        except (RuntimeError, TypeError):
            raise TensorTransportError(f"tensor {meta.name!r}: its bytes do not make its shape and dtype") from None
    return out


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TensorTransportError(f"{name!r} is a {type(value).__name__}, not a tensor")
    return value.detach()
