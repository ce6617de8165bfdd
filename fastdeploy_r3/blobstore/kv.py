"""The KV storage tier's backends: block blobs under validated hex keys, in a file tree, Redis or Mooncake.

A stored block is one blob (its codec: cache_manager/storage.py) under the block's key, the hex of its
content hash computed by the engine. Keys live under a namespace derived from model identity + weight
version, so blocks computed by other weights are simply not found. No backend ever wipes the store on
start. `open_blob_store(url, namespace)` (blobstore/__init__.py) picks the backend from the URL.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from fastdeploy_r3.blobstore.base import CHECKSUM_NBYTES, DIR_MODE, BlobStore, BlobStoreError, redact_url
from fastdeploy_r3.blobstore.disk_budget import DiskBudget
from fastdeploy_r3.blobstore.health import StoreHealth
from fastdeploy_r3.blobstore.local import LocalBlobStore
from fastdeploy_r3.blobstore.redis import RedisBlobStore

logger = logging.getLogger(__name__)

_KEY_RE = re.compile(r"^[0-9a-f]{1,128}$")


class StorageError(RuntimeError):
    """The storage backend cannot be used (bad URL, unreachable, write failed)."""


class InvalidStorageKeyError(ValueError):
    """A storage key is not lowercase hex; keys are block hashes, never user text."""


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
    """Block blobs in a BlobStore (blobstore/base.py) under validated hex keys.

    `get` never raises for a missing or unreadable value: it logs and returns None (a miss), because a
    storage hiccup must only cost recomputation; `exists` likewise answers False. `put` raises
    StorageError when the value was not stored. A backend is a BlobStore plus a branch in
    open_blob_store (Mooncake: MooncakeBlobStore in blobstore/mooncake.py).

    Stored blocks are immutable: a put under a key that holds the same bytes (same checksum trailer)
    is a no-op, one that holds other bytes is refused, so nobody can replace what other engines load.
    Every call goes through `health` (blobstore/health.py): a store that failed is skipped (a miss, or a
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
        from fastdeploy_r3.blobstore.mooncake import MooncakeBlobStore  # needs the mooncake extra

        prefix = f"fdr3:kv:{namespace_prefix(namespace)}:"
        try:
            blobs = MooncakeBlobStore(url, pin=False, segment_bytes=0 if lookup_only else None)
        except BlobStoreError as e:
            raise StorageError(f"KV storage {redact_url(url)}: {e}") from e
        super().__init__(blobs, lambda key: prefix + key)
