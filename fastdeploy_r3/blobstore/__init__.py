"""The storage room: blob stores (flat key -> bytes) and what keeps them healthy and bounded.

    base.py         BlobStore, ChecksummedBlobStore, checksum trailer, atomic private writes, redact_url
    local.py        LocalBlobStore: files under a directory
    redis.py        RedisBlobStore: one Redis string per key under a prefix
    mooncake.py     MooncakeBlobStore: objects in a Mooncake cluster (needs the mooncake extra)
    health.py       StoreHealth / DeadlineCaller: a failing store is skipped until a probe answers
    disk_budget.py  DiskBudget: capacity (least recently used go first) and age of a file tree
    kv.py           the KV storage tier's backends (immutable block blobs under hex keys)
    open_blob_store(url, namespace)  file:// | redis:// | mooncake:// -> the KV storage backend

Both the KV tier (cache_manager/) and the R3 stores (r3/stores/) build on this room, so neither has to
import the other. It imports nothing else of the package.
"""

from __future__ import annotations

from urllib.parse import urlparse

from fastdeploy_r3.blobstore.kv import (
    FileStorageBackend,
    KVStorageBackend,
    MooncakeStorageBackend,
    RedisStorageBackend,
    StorageError,
)

__all__ = ["open_blob_store"]


def open_blob_store(url: str, namespace: str, timeout_s: float = 30.0, must_answer: bool = True,
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
