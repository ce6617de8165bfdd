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
    """`[rows, num_hidden_layers, K]` (any integer dtype) -> base64 of its raw int32 bytes, C order (the
    text of sglang_routed_experts_b64)."""
    return bytes(sglang_routed_experts_b64(arr)).decode("ascii")


def sglang_routed_experts_b64(arr: np.ndarray) -> memoryview:
    """The ASCII bytes of encode_sglang_routed_experts, in one buffer written once: the API server splices
    them into the answer's bytes (entrypoints/payload_json.py) with no str in between, since each copy of
    a 30B model's ~1.5 MB payload is paid 256 times when a batch of streams finishes in one step.

    Ids in [0, 65536) (every expert id and the uint8/uint16 sentinels) are encoded through lookup
    tables: three little-endian int32 ids are 12 bytes, i.e. 4 base64 groups of 3 bytes, and each group
    depends on one id only (a0 a1 0 | 0 b0 b1 | 0 0 c0 | c1 0 0), so the text is 4 table gathers, numpy
    passes that let other threads run (binascii holds the GIL for the whole payload; the API server
    encodes the answers of a step's finished requests in threads at once)."""
    flat = np.asarray(arr).reshape(-1)
    whole = flat.size - flat.size % 3
    if flat.size == 0 or flat.min() < 0 or flat.max() >= 1 << 16:
        return memoryview(base64.b64encode(np.ascontiguousarray(flat, dtype="<i4").view(np.uint8)))
    ids = flat[:whole].reshape(-1, 3)
    t1, t2, t3, t4 = _b64_tables()
    tail = base64.b64encode(np.ascontiguousarray(flat[whole:], dtype="<i4").view(np.uint8))
    out = np.empty(ids.shape[0] * 16 + len(tail), dtype=np.uint8)
    groups = out[: ids.shape[0] * 16].view("<u4").reshape(-1, 4)  # 4 chars per uint32, the first in its lowest byte
    np.take(t1, ids[:, 0], out=groups[:, 0])
    np.take(t2, ids[:, 1], out=groups[:, 1])
    np.take(t3, ids[:, 2], out=groups[:, 2])
    np.take(t4, ids[:, 2], out=groups[:, 3])
    out[ids.shape[0] * 16:] = np.frombuffer(tail, dtype=np.uint8)
    return memoryview(out)


_TABLES: tuple[np.ndarray, ...] = ()


def _b64_tables() -> tuple[np.ndarray, ...]:
    """Four uint32 tables over 16-bit ids: the base64 group (4 chars) of bytes (v0, v1, 0), (0, v0, v1),
    (0, 0, v0) and (v1, 0, 0), where v0, v1 are the id's low and high bytes."""
    global _TABLES
    if not _TABLES:
        alphabet = np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/", dtype=np.uint8)
        v = np.arange(1 << 16, dtype=np.uint32)
        lo, hi, zero = v & 0xFF, v >> 8, np.zeros_like(v)

        def group(b0: np.ndarray, b1: np.ndarray, b2: np.ndarray) -> np.ndarray:
            n = (b0 << 16) | (b1 << 8) | b2
            c = [alphabet[(n >> shift) & 63].astype(np.uint32) for shift in (18, 12, 6, 0)]
            return (c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24)).astype("<u4")

        _TABLES = (group(lo, hi, zero), group(zero, lo, hi), group(zero, zero, lo), group(hi, zero, zero))
    return _TABLES


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
