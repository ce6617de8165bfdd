"""R3 on the wire and in the stores.

    .npy        self-describing dtype and shape: the `routed_experts` field of a choice (base64) and
                the value of every store entry; what vLLM-style trainers decode
    sglang      base64 of raw int32 `[len(tokens) - 1, num_hidden_layers, K]`, no header: the
                `meta_info["routed_experts"]` of the SGLang-style /generate that slime reads
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np


class RoutedExpertsDecodeError(ValueError):
    """A payload or stored value is not an R3 array of integer expert ids."""


def npy_bytes(arr: np.ndarray) -> bytes:
    """The `.npy` file of `arr`."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


def load_npy(data: bytes, what: str) -> np.ndarray:
    """Inverse of npy_bytes; refuses pickles and non-integer arrays. `what` names the source in errors."""
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise RoutedExpertsDecodeError(f"{what} is not a .npy array: {e}") from e
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu":
        raise RoutedExpertsDecodeError(f"{what} holds {getattr(arr, 'dtype', type(arr))}, not integer expert ids")
    return arr


def _b64decode(b64: str, what: str) -> bytes:
    try:
        return base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RoutedExpertsDecodeError(f"{what} is not base64: {e}") from e


def encode_routed_experts(arr: np.ndarray) -> str:
    """`[rows, L, K]` -> base64 of an `.npy` file (the `routed_experts` field of a choice)."""
    return base64.b64encode(npy_bytes(arr)).decode("ascii")


def decode_routed_experts(b64: str) -> np.ndarray:
    """base64 `.npy` payload -> `[rows, L, K]` integer array (uint8/uint16/int32, as sent)."""
    arr = load_npy(_b64decode(b64, "routed_experts"), "routed_experts")
    if arr.ndim != 3:
        raise RoutedExpertsDecodeError(f"routed_experts has shape {arr.shape}; expected [rows, L, K]")
    return arr


def encode_sglang_routed_experts(arr: np.ndarray) -> str:
    """`[rows, num_hidden_layers, K]` (any integer dtype) -> base64 of its raw int32 bytes, C order."""
    raw = np.ascontiguousarray(arr, dtype="<i4")  # one pass; base64 reads its buffer (no bytes copy)
    return base64.b64encode(raw.reshape(-1).view(np.uint8)).decode("ascii")


def decode_sglang_routed_experts(b64: str, num_hidden_layers: int, top_k: int) -> np.ndarray:
    """Inverse of encode_sglang_routed_experts: `[rows, num_hidden_layers, K]` int32 (the payload has no shape)."""
    data = _b64decode(b64, "meta_info.routed_experts")
    row_bytes = num_hidden_layers * top_k * 4
    if row_bytes <= 0 or len(data) % row_bytes:
        raise RoutedExpertsDecodeError(
            f"meta_info.routed_experts has {len(data)} bytes, not a multiple of one row "
            f"({num_hidden_layers} layers x {top_k} experts x 4 bytes); check num_hidden_layers and K"
        )
    return np.frombuffer(data, dtype=np.int32).reshape(-1, num_hidden_layers, top_k).copy()
