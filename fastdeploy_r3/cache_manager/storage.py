"""The block blob codec of the KV storage tier: one stored block is one blob under the block's key.

    header | KV of rank 0 | ... | KV of rank R-1 | routing rows [block_size, L, K] | xxh3_64 checksum

The checksum covers everything before it, header and routing rows included: rows have no checksum of
their own. Provenance tags are engine-local and never stored; whoever loads a block stamps its rows
with a fresh tag. Where blobs are kept (file, Redis, Mooncake) is the storage room's business:
fastdeploy_r3/blobstore/kv.py.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fastdeploy_r3.blobstore.base import CHECKSUM_NBYTES, ChecksumError, checksummed, verify_checksum


class BlockDecodeError(ValueError):
    """A stored blob is truncated, corrupt, or laid out for another model/parallelism: treat it as a miss."""


class CorruptBlockError(BlockDecodeError):
    """A stored blob is truncated or fails its checksum: garbage no engine can use, so its finder deletes it
    (stored blocks are immutable, and a corrupt one would otherwise refuse every good put of its key)."""


_MAGIC = b"FDR3KVB\x00"
_VERSION = 1
# magic, version, num_ranks, kv dtype, kv ndim, kv shape (<= 6 dims), rows dtype ("" = no rows),
# rows shape, kv bytes per rank, rows bytes
_HEADER = struct.Struct("<8sHH16sB6I8s3IQQ")
HEADER_NBYTES = _HEADER.size  # a blob's KV of rank 0 starts here (PD writes blobs' pieces in place)


@dataclass(frozen=True)
class BlockLayout:
    """What one stored block must look like for this engine; a blob that differs is a miss."""

    num_ranks: int
    kv_shape: tuple[int, ...]  # per rank and block: [num_layers, 2, block_size, num_kv_heads, head_dim]
    kv_dtype: str  # torch dtype name, e.g. "bfloat16"
    kv_itemsize: int
    rows_shape: tuple[int, int, int] | None = None  # [block_size, L, K]; None when R3 is off
    rows_dtype: str | None = None  # numpy dtype name

    @property
    def kv_nbytes(self) -> int:
        return int(np.prod(self.kv_shape)) * self.kv_itemsize

    @property
    def rows_nbytes(self) -> int:
        if self.rows_shape is None:
            return 0
        return int(np.prod(self.rows_shape)) * np.dtype(self.rows_dtype).itemsize

    @property
    def blob_nbytes(self) -> int:
        return _HEADER.size + self.num_ranks * self.kv_nbytes + self.rows_nbytes + CHECKSUM_NBYTES

    def header(self) -> bytes:
        """The header every blob of this layout starts with (its checksum covers it)."""
        return self._header()

    def _header(self) -> bytes:
        kv_shape = tuple(self.kv_shape) + (0,) * (6 - len(self.kv_shape))
        rows_shape = self.rows_shape or (0, 0, 0)
        return _HEADER.pack(
            _MAGIC, _VERSION, self.num_ranks, self.kv_dtype.encode(), len(self.kv_shape), *kv_shape,
            (self.rows_dtype or "").encode(), *rows_shape, self.kv_nbytes, self.rows_nbytes,
        )  # fmt: skip


def _as_bytes(part: np.ndarray | bytes | memoryview) -> memoryview:
    if isinstance(part, np.ndarray):
        part = np.ascontiguousarray(part)
    return memoryview(part).cast("B")


def encode_block(layout: BlockLayout, kv: Sequence[np.ndarray | bytes | memoryview], rows: np.ndarray | None) -> bytes:
    """One blob from the block's KV of every rank (raw bytes, rank order) and its routing rows [block_size, L, K]."""
    if len(kv) != layout.num_ranks:
        raise ValueError(f"encode_block: got KV of {len(kv)} ranks, layout has {layout.num_ranks}")
    parts = [_as_bytes(p) for p in kv]
    for rank, p in enumerate(parts):
        if p.nbytes != layout.kv_nbytes:
            raise ValueError(f"encode_block: KV of rank {rank} has {p.nbytes} bytes, layout says {layout.kv_nbytes}")
    if layout.rows_shape is not None:
        if rows is None or rows.shape != layout.rows_shape or rows.dtype != np.dtype(layout.rows_dtype):
            got = None if rows is None else (rows.shape, rows.dtype)
            raise ValueError(f"encode_block: rows {got} do not match {layout.rows_shape} {layout.rows_dtype}")
        parts.append(_as_bytes(rows))
    return checksummed([layout._header(), *parts])


def decode_block(blob: bytes, layout: BlockLayout) -> tuple[list[np.ndarray], np.ndarray | None]:
    """(KV bytes of each rank as uint8 [kv_nbytes], rows [block_size, L, K] or None); views into `blob`.

    Raises BlockDecodeError for a truncated or corrupt blob or one laid out for another engine shape.
    """
    if len(blob) < _HEADER.size + CHECKSUM_NBYTES:
        raise CorruptBlockError(f"blob of {len(blob)} bytes is shorter than a header: truncated")
    fields = _HEADER.unpack_from(blob, 0)
    magic, version, num_ranks, kv_dtype, kv_ndim = fields[:5]
    if magic != _MAGIC:
        raise CorruptBlockError(f"bad magic {magic!r}: not a fastdeploy_r3 block blob")
    if version != _VERSION:
        raise BlockDecodeError(f"blob format version {version}, this engine reads {_VERSION}")
    kv_nbytes, rows_nbytes = fields[-2:]
    expected_len = _HEADER.size + num_ranks * kv_nbytes + rows_nbytes + CHECKSUM_NBYTES
    if len(blob) != expected_len:
        raise CorruptBlockError(f"blob has {len(blob)} bytes, its header says {expected_len}: truncated or padded")
    try:
        verify_checksum(blob)
    except ChecksumError as e:
        raise CorruptBlockError(f"stored block: {e}") from e
    kv_shape = tuple(fields[5 : 5 + kv_ndim])
    rows_dtype = fields[11].rstrip(b"\x00").decode()
    rows_shape = tuple(fields[12:15]) if rows_dtype else None
    stored = (num_ranks, kv_shape, kv_dtype.rstrip(b"\x00").decode())
    wanted = (layout.num_ranks, tuple(layout.kv_shape), layout.kv_dtype)
    if stored != wanted:
        raise BlockDecodeError(f"stored KV layout (ranks, shape, dtype) {stored} differs from this engine's {wanted}")
    if layout.rows_shape is not None and (rows_shape, rows_dtype) != (tuple(layout.rows_shape), layout.rows_dtype):
        raise BlockDecodeError(
            f"stored routing rows {rows_shape} {rows_dtype or 'absent'} differ from this engine's "
            f"{layout.rows_shape} {layout.rows_dtype}"
        )
    data = np.frombuffer(blob, dtype=np.uint8)
    off = _HEADER.size
    kv = []
    for _ in range(num_ranks):
        kv.append(data[off : off + kv_nbytes])
        off += kv_nbytes
    rows = None
    if layout.rows_shape is not None:
        rows = data[off : off + rows_nbytes].view(np.dtype(rows_dtype)).reshape(rows_shape)
    return kv, rows
