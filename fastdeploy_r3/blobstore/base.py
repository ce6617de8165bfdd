"""Blob stores: flat key -> bytes, the one base under the KV storage tier (blobstore/kv.py) and the
R3 stores (r3/stores/).

It has a room of its own (blobstore/) because both the KV tier and R3 use it and neither should
import the other for it: the trainer-side client reads R3 stores without loading the KV cache
manager, and the KV tier has no business with the R3 payload.

    BlobStore           put / get / exists / delete (+ put_many / get_many); a missing key is None
      LocalBlobStore    local.py: files under a root directory; a key is a relative path; atomic writes
      RedisBlobStore    redis.py: one string per key under a prefix; errors never show the URL's password
      MooncakeBlobStore mooncake.py: objects in a Mooncake cluster's memory segments
      ChecksummedBlobStore  any of them, with every value ending in its xxh3_64 (checksummed)
    checksummed / verify_checksum   an xxh3_64 trailer for values that must not be trusted as read

A backend plugs in by implementing the five abstract methods. Its contract, which callers rely on:
`get` returns None (never b"") for a key that is not there, so a client whose get answers b"" for a
miss (Mooncake) maps that to None; objects may vanish at any time (expiry, eviction), so callers
treat a None from `get` after a True from `exists` as a miss, not as an error; `put` returns only
once the value is stored, and raises BlobStoreError otherwise; `ttl_s` is honoured where the backend
has expiry (a local directory has none: its files stay until deleted).
"""

from __future__ import annotations

import abc
import os
import re
import secrets
import struct
from collections.abc import Sequence
from typing import BinaryIO

import xxhash


class BlobStoreError(RuntimeError):
    """A blob store operation did not complete (unreachable, refused, I/O error)."""


def redact_url(url: str) -> str:
    """A URL without its password, for messages and metadata."""
    return re.sub(r"//([^:@/]*):[^@/]*@", r"//\1:***@", url)


# Stored R3 and KV are the users' data: readable by the server's user only (issue 11)
FILE_MODE = 0o600
DIR_MODE = 0o700


def open_new_private(path: str) -> BinaryIO:
    """Create `path` (it must not exist) 0600, narrowed by the umask, for writing."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb")


def write_atomic(path: str, data: bytes | memoryview) -> None:
    """Write to a private temp name and rename: a reader sees the old file, no file, or the whole new one.

    The file is created 0600 and missing directories 0700 (both further narrowed by the umask)."""
    os.makedirs(os.path.dirname(path), mode=DIR_MODE, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        with open_new_private(tmp) as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


_CHECKSUM = struct.Struct("<Q")
CHECKSUM_NBYTES = _CHECKSUM.size


class ChecksumError(ValueError):
    """A value is shorter than its checksum or its bytes do not match it: corrupt or truncated."""


def checksummed(parts: Sequence[bytes | memoryview]) -> bytes:
    """parts joined, followed by the xxh3_64 of all of them (8 bytes, little endian)."""
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return b"".join([*parts, _CHECKSUM.pack(h.intdigest())])


def stored_checksum(blob: bytes) -> int:
    """The xxh3_64 a checksummed blob ends with (not verified: verify_checksum does that)."""
    if len(blob) < _CHECKSUM.size:
        raise ChecksumError(f"blob of {len(blob)} bytes has no checksum: truncated")
    return _CHECKSUM.unpack_from(blob, len(blob) - _CHECKSUM.size)[0]


def verify_checksum(blob: bytes) -> memoryview:
    """The payload of a checksummed blob (a view, trailer stripped); ChecksumError if it does not match."""
    stored = stored_checksum(blob)
    mv = memoryview(blob)
    if xxhash.xxh3_64_intdigest(mv[: -_CHECKSUM.size]) != stored:
        raise ChecksumError("checksum mismatch: the stored value is corrupt")
    return mv[: -_CHECKSUM.size]


class BlobStore(abc.ABC):
    """Flat key -> bytes. Keys are validated by the caller (hex block hashes, rollout ids)."""

    @abc.abstractmethod
    def put(self, key: str, value: bytes, ttl_s: int | None = None) -> None: ...

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value, or None when the key is not there; BlobStoreError when the store cannot answer."""

    @abc.abstractmethod
    def exists(self, keys: list[str]) -> list[bool]: ...

    @abc.abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Remove the keys; a key that is not there is not an error."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def put_many(self, items: dict[str, bytes], ttl_s: int | None = None) -> None:
        """Store every item, or raise. Backends with transactions make it all-or-nothing for readers."""
        for key, value in items.items():
            self.put(key, value, ttl_s)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def put_if_absent(self, key: str, value: bytes, ttl_s: int | None = None) -> bool:
        """Store the value unless the key exists; True when stored. Backends make it atomic where they can."""
        if self.exists([key])[0]:
            return False
        self.put(key, value, ttl_s)
        return True

    def tail(self, key: str, nbytes: int) -> bytes | None:
        """The last `nbytes` of the value (its checksum trailer), or None when the key is not there."""
        value = self.get(key)
        return None if value is None else value[-nbytes:]


class ChecksummedBlobStore(BlobStore):
    """`inner` with every value stored as `checksummed([value])`; `get` raises ChecksumError (naming the
    key) for a value that is short or does not match, so a corrupt value is never returned as data.

    For values that carry no checksum of their own and live where bytes can go missing under the
    reader (the R3 `.npy` values in Mooncake); KV blocks need none, their codec checksums them.
    """

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner

    def put(self, key: str, value: bytes | memoryview, ttl_s: int | None = None) -> None:
        self.inner.put(key, checksummed([value]), ttl_s)

    def put_many(self, items: dict[str, bytes], ttl_s: int | None = None) -> None:
        self.inner.put_many({k: checksummed([v]) for k, v in items.items()}, ttl_s)

    def put_if_absent(self, key: str, value: bytes, ttl_s: int | None = None) -> bool:
        return self.inner.put_if_absent(key, checksummed([value]), ttl_s)

    def _verified(self, key: str, blob: bytes | None) -> bytes | None:
        if blob is None:
            return None
        try:
            return bytes(verify_checksum(blob))
        except ChecksumError as e:
            raise ChecksumError(f"value of {key!r}: {e}") from e

    def get(self, key: str) -> bytes | None:
        return self._verified(key, self.inner.get(key))

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return [self._verified(k, v) for k, v in zip(keys, self.inner.get_many(keys), strict=True)]

    def exists(self, keys: list[str]) -> list[bool]:
        return self.inner.exists(keys)

    def delete(self, keys: list[str]) -> None:
        self.inner.delete(keys)

    def close(self) -> None:
        self.inner.close()
