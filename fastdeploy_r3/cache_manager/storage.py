"""Storage tier for KV blocks (and their R3 rows): backends and the block blob codec.

A stored block is one blob under the block's key (hex of its content hash, computed by the engine):

    header | KV of rank 0 | ... | KV of rank R-1 | routing rows [block_size, L, K] | xxh3_64 checksum

The checksum covers everything before it, header and routing rows included: rows have no checksum of
their own. Provenance tags are engine-local and never stored; whoever loads a block stamps its rows
with a fresh tag. Keys live under a namespace derived from model identity + weight version, so blocks
computed by other weights are simply not found. No backend ever wipes the store on start.
"""

from __future__ import annotations

import abc
import logging
import os
import re
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlparse

import numpy as np
import xxhash

logger = logging.getLogger(__name__)

_KEY_RE = re.compile(r"^[0-9a-f]{1,128}$")


class StorageError(RuntimeError):
    """The storage backend cannot be used (bad URL, unreachable, write failed)."""


class InvalidStorageKeyError(ValueError):
    """A storage key is not lowercase hex; keys are block hashes, never user text."""


class BlockDecodeError(ValueError):
    """A stored blob is truncated, corrupt, or laid out for another model/parallelism: treat it as a miss."""


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


class KVStorageBackend(abc.ABC):
    """A flat key -> bytes store. Keys are validated hex; values are whole block blobs.

    `get` never raises for a missing or unreadable value: it logs and returns None (a miss), because a
    storage hiccup must only cost recomputation. `put` raises StorageError when the value was not stored.
    """

    @abc.abstractmethod
    def put(self, key: str, value: bytes) -> None: ...

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    def exists(self, keys: list[str]) -> list[bool]: ...

    @abc.abstractmethod
    def delete(self, keys: list[str]) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class FileStorageBackend(KVStorageBackend):
    """`file:///abs/dir`: one file per block under `<dir>/<namespace prefix>/<key[:2]>/<key>`."""

    def __init__(self, root: str, namespace: str) -> None:
        if not os.path.isabs(root):
            raise StorageError(f"file storage directory {root!r} is not absolute; use file:///absolute/dir")
        self.dir = os.path.join(root, namespace_prefix(namespace))
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create file storage directory {self.dir}: {e}") from e

    def path_for(self, key: str) -> str:
        validate_key(key)
        return os.path.join(self.dir, key[:2], key)

    def put(self, key: str, value: bytes) -> None:
        path = self.path_for(key)
        # Write to a private temp name and rename: a reader (another engine) sees the old file, no file,
        # or the whole new one, never a torn write.
        tmp = f"{path}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(value)
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise StorageError(f"cannot write block {key} to {path}: {e}") from e

    def get(self, key: str) -> bytes | None:
        path = self.path_for(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("file storage: cannot read block %s from %s: %s (treated as a miss)", key, path, e)
            return None

    def exists(self, keys: list[str]) -> list[bool]:
        return [os.path.exists(self.path_for(k)) for k in keys]

    def delete(self, keys: list[str]) -> None:
        for k in keys:
            try:
                os.unlink(self.path_for(k))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Nothing to release: every operation opens and closes its own file."""


class RedisStorageBackend(KVStorageBackend):
    """`redis://host:port/db`: one string value per block under `fdr3:kv:<namespace prefix>:<key>`."""

    def __init__(self, url: str, namespace: str) -> None:
        import redis  # only the Redis backend needs the client

        self._redis_error = redis.RedisError
        self.prefix = f"fdr3:kv:{namespace_prefix(namespace)}:"
        self._r = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30)
        try:
            self._r.ping()
        except redis.RedisError as e:
            raise StorageError(f"redis storage at {url} is unreachable: {e}; start it or fix storage_url") from e

    def redis_key(self, key: str) -> str:
        return self.prefix + validate_key(key)

    def put(self, key: str, value: bytes) -> None:
        try:
            self._r.set(self.redis_key(key), value)
        except self._redis_error as e:
            raise StorageError(f"redis: cannot store block {key}: {e}") from e

    def get(self, key: str) -> bytes | None:
        try:
            return self._r.get(self.redis_key(key))
        except self._redis_error as e:
            logger.warning("redis storage: cannot read block %s: %s (treated as a miss)", key, e)
            return None

    def exists(self, keys: list[str]) -> list[bool]:
        # One round trip for the whole prefix, not one per block.
        pipe = self._r.pipeline(transaction=False)
        for k in keys:
            pipe.exists(self.redis_key(k))
        try:
            return [bool(n) for n in pipe.execute()]
        except self._redis_error as e:
            logger.warning("redis storage: exists() failed: %s (treated as all misses)", e)
            return [False] * len(keys)

    def delete(self, keys: list[str]) -> None:
        if keys:
            self._r.delete(*[self.redis_key(k) for k in keys])

    def close(self) -> None:
        self._r.close()


def make_storage_backend(url: str, namespace: str) -> KVStorageBackend:
    """`file:///abs/dir`, `redis://host:port/db` or `mooncake://master:port?...`; keys namespaced by `namespace`."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise StorageError(f"file storage URL {url!r} names a host; use file:///absolute/dir")
        return FileStorageBackend(parsed.path, namespace)
    if parsed.scheme in ("redis", "rediss", "unix"):
        return RedisStorageBackend(url, namespace)
    if parsed.scheme == "mooncake":
        from fastdeploy_r3.cache_manager.mooncake_backends import MooncakeStorageBackend

        return MooncakeStorageBackend(url, namespace)
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
_CHECKSUM = struct.Struct("<Q")


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
        return _HEADER.size + self.num_ranks * self.kv_nbytes + self.rows_nbytes + _CHECKSUM.size

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
    header = layout._header()
    h = xxhash.xxh3_64(header)
    for p in parts:
        h.update(p)
    return b"".join([header, *parts, _CHECKSUM.pack(h.intdigest())])


def decode_block(blob: bytes, layout: BlockLayout) -> tuple[list[np.ndarray], np.ndarray | None]:
    """(KV bytes of each rank as uint8 [kv_nbytes], rows [block_size, L, K] or None); views into `blob`.

    Raises BlockDecodeError for a truncated or corrupt blob or one laid out for another engine shape.
    """
    if len(blob) < _HEADER.size + _CHECKSUM.size:
        raise BlockDecodeError(f"blob of {len(blob)} bytes is shorter than a header: truncated")
    fields = _HEADER.unpack_from(blob, 0)
    magic, version, num_ranks, kv_dtype, kv_ndim = fields[:5]
    if magic != _MAGIC:
        raise BlockDecodeError(f"bad magic {magic!r}: not a fastdeploy_r3 block blob")
    if version != _VERSION:
        raise BlockDecodeError(f"blob format version {version}, this engine reads {_VERSION}")
    kv_nbytes, rows_nbytes = fields[-2:]
    expected_len = _HEADER.size + num_ranks * kv_nbytes + rows_nbytes + _CHECKSUM.size
    if len(blob) != expected_len:
        raise BlockDecodeError(f"blob has {len(blob)} bytes, its header says {expected_len}: truncated or padded")
    mv = memoryview(blob)
    (stored_sum,) = _CHECKSUM.unpack_from(blob, len(blob) - _CHECKSUM.size)
    if xxhash.xxh3_64_intdigest(mv[: -_CHECKSUM.size]) != stored_sum:
        raise BlockDecodeError("checksum mismatch: the stored block is corrupt")
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
