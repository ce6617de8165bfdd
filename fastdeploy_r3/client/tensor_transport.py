"""Trainer side of `/update_weights_from_tensor`: named tensors serialized by reference, as SGLang's
`MultiprocessingSerializer.serialize(named_tensors, output_str=True)` does, so a colocated trainer
hands its weights to the engine without copying them through the host or the HTTP body.

    CUDA tensors travel as CUDA IPC handles; CPU tensors are moved into shared memory and travel as
    the file names of torch's "file_system" sharing strategy (any process of the same user can open
    them, unlike file descriptors, which only the sender's own children may receive).

The tensors must stay alive (referenced by the caller) until the server has answered.
"""

from __future__ import annotations

import base64
import contextlib
import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing


@dataclass
class FlattenedTensorMetadata:
    """SGLang's metadata of one tensor in a flattened bucket (the engine maps it by this class name)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


def serialize(obj: Any) -> str:
    """ForkingPickler + base64 (SGLang's MultiprocessingSerializer with output_str=True)."""
    buf = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """One rank's payload of load_format "direct"."""
    return serialize([(name, t.detach()) for name, t in named_tensors])


def flattened_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Many tensors in one byte buffer (load_format "flattened_bucket"): one IPC handle instead of hundreds."""
    parts, metadata, start = [], [], 0
    for name, t in named_tensors:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name, t.shape, t.dtype, start, start + flat.numel(), flat.numel()))
        parts.append(flat)
        start += flat.numel()
    return {"flattened_tensor": torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8),
            "metadata": metadata}
