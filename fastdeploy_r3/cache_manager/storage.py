"""Storage tier for KV blocks (and their R3 rows): backends and the block blob codec.

A stored block is one blob under the block's key (hex of its content hash, computed by the engine):

    header | KV of rank 0 | ... | KV of rank R-1 | routing rows [block_size, L, K] | xxh3_64 checksum

The checksum covers everything before it, header and routing rows included: rows have no checksum of
their own. Provenance tags are engine-local and never stored; whoever loads a block stamps its rows
with a fresh tag. Keys live under a namespace derived from model identity + weight version, so blocks
computed by other weights are simply not found. No backend ever wipes the store on start.
"""

from __future__ import annotations

import logging
import os
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlparse

import numpy as np
import xxhash

from fastdeploy_r3.blob_store import (
    CHECKSUM_NBYTES,
    DIR_MODE,
    BlobStore,
    BlobStoreError,
    ChecksumError,
    LocalBlobStore,
    RedisBlobStore,
    checksummed,
    redact_url,
    verify_checksum,
)
from fastdeploy_r3.disk_budget import DiskBudget
from fastdeploy_r3.store_health import StoreHealth

logger = logging.getLogger(__name__)

_KEY_RE = re.compile(r"^[0-9a-f]{1,128}$")


class StorageError(RuntimeError):
    """The storage backend cannot be used (bad URL, unreachable, write failed)."""


class InvalidStorageKeyError(ValueError):
    """A storage key is not lowercase hex; keys are block hashes, never user text."""


class BlockDecodeError(ValueError):
    """A stored blob is truncated, corrupt, or laid out for another model/parallelism: treat it as a miss."""


class CorruptBlockError(BlockDecodeError):
    """A stored blob is truncated or fails its checksum: garbage no engine can use, so its finder deletes it
    (stored blocks are immutable, and a corrupt one would otherwise refuse every good put of its key)."""


def validate_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise InvalidStorageKeyError(
            f"storage key {key!r} is not 1-128 lowercase hex characters; pass the hex digest of the block hash"
        )
    return key


def namespace_prefix(namespace: str) -> str:
    """Short hex prefix for a namespace (model identity + weight version) that is safe in paths and keys."""
    if not namespace:
        raise StorageError(
            "storage namespace is empty; pass model identity + weight version so that blocks of other weights "
            "are never loaded"
        )
    return xxhash.xxh64_hexdigest(namespace.encode())


@dataclass
class StorageCounters:
    puts: int = 0
    put_duplicates: int = 0  # the same bytes were already stored under the key
    put_conflicts: int = 0  # other bytes were stored under the key: refused, the stored ones stay
    put_failures: int = 0


class KVStorageBackend:
    """Block blobs in a BlobStore (fastdeploy_r3/blob_store.py) under validated hex keys.

    `get` never raises for a missing or unreadable value: it logs and returns None (a miss), because a
    storage hiccup must only cost recomputation; `exists` likewise answers False. `put` raises
    StorageError when the value was not stored. A backend is a BlobStore plus a branch in
    make_storage_backend (Mooncake: MooncakeBlobStore in mooncake_store.py).

    Stored blocks are immutable: a put under a key that holds the same bytes (same checksum trailer)
    is a no-op, one that holds other bytes is refused, so nobody can replace what other engines load.
    Every call goes through `health` (store_health.py): a store that failed is skipped (a miss, or a
    put refused at once) until a probe every few seconds finds it back.
    """

    def __init__(self, blobs: BlobStore, blob_key: Callable[[str], str], ttl_s: int | None = None) -> None:
        self.blobs = blobs
        self._blob_key = blob_key  # block key -> key in the blob store (namespaced)
        self.ttl_s = ttl_s
        self.health = StoreHealth("kv storage")
        self.counters = StorageCounters()

    def blob_key(self, key: str) -> str:
        return self._blob_key(validate_key(key))

    def put(self, key: str, value: bytes) -> None:
        blob_key = self.blob_key(key)
        if not self.health.should_try():
            self.counters.put_failures += 1
            raise StorageError(f"block {key} not stored: {self.health.degraded}")
        try:
            stored = self.blobs.put_if_absent(blob_key, value, self.ttl_s)
            existing = None if stored else self.blobs.tail(blob_key, CHECKSUM_NBYTES)
        except BlobStoreError as e:
            self.health.failed(str(e))
            self.counters.put_failures += 1
            raise StorageError(f"cannot store block {key}: {e}") from e
        self.health.ok()
        if stored or existing is None:  # None: it expired between the two calls; the next put stores it
            self.counters.puts += int(stored)
            return
        if existing == bytes(value[-CHECKSUM_NBYTES:]):
            self.counters.put_duplicates += 1
            return
        self.counters.put_conflicts += 1
        raise StorageError(f"block {key} is stored with other bytes; stored blocks are immutable, so this put "
                           "is refused and the stored block stays")

    def get(self, key: str) -> bytes | None:
        blob_key = self.blob_key(key)
        if not self.health.should_try():
            return None
        try:
            value = self.blobs.get(blob_key)
        except BlobStoreError as e:
            self.health.failed(str(e))
            logger.warning("storage: cannot read block %s: %s (treated as a miss)", key, e)
            return None
        self.health.ok()
        return value

    def exists(self, keys: list[str]) -> list[bool]:
        blob_keys = [self.blob_key(k) for k in keys]
        if not self.health.should_try():
            return [False] * len(keys)
        try:
            found = self.blobs.exists(blob_keys)
        except BlobStoreError as e:
            self.health.failed(str(e))
            logger.warning("storage: exists() failed: %s (treated as all misses)", e)
            return [False] * len(keys)
        self.health.ok()
        return found

    def delete(self, keys: list[str]) -> None:
        blob_keys = [self.blob_key(k) for k in keys]
        try:
            self.blobs.delete(blob_keys)
        except BlobStoreError as e:
            raise StorageError(f"cannot delete blocks: {e}") from e

    def close(self) -> None:
        self.blobs.close()


class FileStorageBackend(KVStorageBackend):
    """`file:///abs/dir`: one file per block under `<dir>/<namespace prefix>/<key[:2]>/<key>`, bounded by
    a DiskBudget (capacity with least-recently-used eviction, and age) when one is given."""

    def __init__(self, root: str, namespace: str, ttl_s: int | None = None, capacity_bytes: int | None = None) -> None:
        if not os.path.isabs(root):
            raise StorageError(f"file storage directory {root!r} is not absolute; use file:///absolute/dir")
        self.dir = os.path.join(root, namespace_prefix(namespace))
        try:
            os.makedirs(self.dir, mode=DIR_MODE, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create file storage directory {self.dir}: {e}") from e
        self._files = LocalBlobStore(self.dir)
        super().__init__(self._files, lambda key: os.path.join(key[:2], key))
        self.budget = DiskBudget(self.dir, capacity_bytes, ttl_s)

    def put(self, key: str, value: bytes) -> None:
        try:
            self.budget.admit(len(value))
        except OSError as e:
            raise StorageError(f"cannot make room for block {key}: {e}") from e
        super().put(key, value)

    def get(self, key: str) -> bytes | None:
        path = self._files.path(self.blob_key(key))
        if self.budget.expired(path):
            self.delete([key])
            self.budget.counters.expired += 1
            return None
        value = super().get(key)
        if value is not None:
            self.budget.touch(path)
        return value


class RedisStorageBackend(KVStorageBackend):
    """`redis://host:port/db`: one string value per block under `fdr3:kv:<namespace prefix>:<key>`,
    expiring `ttl_s` after it was stored (Redis's maxmemory policy bounds the bytes)."""

    def __init__(self, url: str, namespace: str, timeout_s: float = 30.0, must_answer: bool = True,
                 ttl_s: int | None = None) -> None:  # fmt: skip
        blobs = RedisBlobStore(url, f"fdr3:kv:{namespace_prefix(namespace)}:", connect_timeout_s=min(5.0, timeout_s),
                               timeout_s=timeout_s)  # fmt: skip
        super().__init__(blobs, lambda key: key, ttl_s)
        try:
            blobs.ping()
        except BlobStoreError as e:
            if must_answer:
                raise StorageError(f"{e}; start it or fix storage_url") from e
            self.health.failed(str(e))  # a replacement CTM starts degraded rather than not at all


class MooncakeStorageBackend(KVStorageBackend):
    """`mooncake://master:port?...`: one object per block under `fdr3:kv:<namespace prefix>:<key>`.

    Objects are not pinned (an evicted block costs a recompute) and carry no trailer of their own: the
    block's checksum (encode_block) already makes a short, flipped or foreign object a miss.
    `lookup_only`: contribute no memory segment (the engine only asks `exists`; the cache transfer
    manager's client holds what it writes).
    """

    def __init__(self, url: str, namespace: str, lookup_only: bool = False) -> None:
        from fastdeploy_r3.mooncake_store import MooncakeBlobStore  # needs the mooncake extra

        prefix = f"fdr3:kv:{namespace_prefix(namespace)}:"
        try:
            blobs = MooncakeBlobStore(url, pin=False, segment_bytes=0 if lookup_only else None)
        except BlobStoreError as e:
            raise StorageError(f"KV storage {redact_url(url)}: {e}") from e
        super().__init__(blobs, lambda key: prefix + key)


def make_storage_backend(url: str, namespace: str, timeout_s: float = 30.0, must_answer: bool = True,
                         ttl_s: int | None = None, capacity_bytes: int | None = None,
                         lookup_only: bool = False) -> KVStorageBackend:  # fmt: skip
    """`file:///abs/dir`, `redis://host:port/db` or `mooncake://master:port?...`; keys are namespaced by a
    hash of `namespace`.

    timeout_s: of one Redis call. must_answer: a Redis that does not answer the first ping is an error
    (False: the backend starts degraded and probes later). ttl_s: stored blocks expire after it (Redis;
    Mooncake evicts unpinned objects itself). capacity_bytes: what a file tier may hold (least recently
    used blocks go first); Redis is bounded by its own maxmemory policy, Mooncake by its segments.
    lookup_only: the caller only asks `exists` (the engine); a Mooncake client then stores nothing itself."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise StorageError(f"file storage URL {url!r} names a host; use file:///absolute/dir")
        return FileStorageBackend(parsed.path, namespace, ttl_s, capacity_bytes)
    if parsed.scheme in ("redis", "rediss", "unix"):
        return RedisStorageBackend(url, namespace, timeout_s, must_answer, ttl_s)
    if parsed.scheme == "mooncake":
        return MooncakeStorageBackend(url, namespace, lookup_only)
    raise StorageError(
        f"unknown storage URL {url!r}; use file:///absolute/dir, redis://host:port/db or mooncake://host:port?..."
    )


# ---------------------------------------------------------------------------------------------------
# Block blob codec

_MAGIC = b"FDR3KVB\x00"
_VERSION = 1
# magic, version, num_ranks, kv dtype, kv ndim, kv shape (<= 6 dims), rows dtype ("" = no rows),
# rows shape, kv bytes per rank, rows bytes
_HEADER = struct.Struct("<8sHH16sB6I8s3IQQ")


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
