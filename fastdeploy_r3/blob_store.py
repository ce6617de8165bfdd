"""Blob stores: flat key -> bytes, the one base under the KV storage tier (cache_manager/storage.py)
and the R3 stores (r3/stores.py).

It sits at the top of the package, beside config.py, because both rooms use it and neither should
import the other for it: the trainer-side client reads R3 stores without loading the KV cache
manager, and the KV tier has no business with the R3 payload.

    BlobStore           put / get / exists / delete (+ put_many / get_many); a missing key is None
      LocalBlobStore    files under a root directory; a key is a relative path; atomic writes
      RedisBlobStore    one string per key under a prefix; errors never show the URL's password
      MooncakeBlobStore mooncake_store.py: objects in a Mooncake cluster's memory segments
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
import shutil
import struct
from collections.abc import Callable, Sequence
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


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


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


def verify_checksum(blob: bytes) -> memoryview:
    """The payload of a checksummed blob (a view, trailer stripped); ChecksumError if it does not match."""
    if len(blob) < _CHECKSUM.size:
        raise ChecksumError(f"blob of {len(blob)} bytes has no checksum: truncated")
    mv = memoryview(blob)
    (stored,) = _CHECKSUM.unpack_from(blob, len(blob) - _CHECKSUM.size)
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


class LocalBlobStore(BlobStore):
    """Files under `root`; key `a/b.npy` is the file `root/a/b.npy`. Values have no expiry."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def put(self, key: str, value: bytes | memoryview, ttl_s: int | None = None) -> None:
        try:
            write_atomic(self.path(key), value)
        except OSError as e:
            raise BlobStoreError(f"cannot write {self.path(key)}: {e}") from e

    def get(self, key: str) -> bytes | None:
        try:
            with open(self.path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise BlobStoreError(f"cannot read {self.path(key)}: {e}") from e

    def exists(self, keys: list[str]) -> list[bool]:
        return [os.path.isfile(self.path(k)) for k in keys]

    def put_many(self, items: dict[str, bytes], ttl_s: int | None = None) -> None:
        """Every item or none, as a reader sees it. Items whose keys share a top directory
        (`rid/layer_3.npy`, `rid/layer_5.npy`) are written into a hidden staging directory that is renamed
        into place whole, so a reader never finds some layers of a rollout without the others; a failure
        anywhere (disk full, read-only) takes back what this call put in place."""
        groups: dict[str, dict[str, bytes]] = {}
        for key, value in items.items():
            top, sep, _ = key.partition("/")
            groups.setdefault(top if sep else "", {})[key] = value
        placed: list[tuple[str, str | None]] = []  # (path put in place, what it replaced, set aside)
        try:
            for top, group in groups.items():
                if top:
                    placed.append(self._put_dir(top, group))
                    continue
                for key, value in group.items():
                    write_atomic(self.path(key), value)
                    placed.append((self.path(key), None))
        except OSError as e:
            for path, aside in reversed(placed):
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    _unlink_quietly(path)
                if aside is not None:
                    os.rename(aside, path)
            raise BlobStoreError(f"cannot write {len(items)} item(s) under {self.root}: {e}") from e
        for _, aside in placed:
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)

    def _put_dir(self, top: str, group: dict[str, bytes]) -> tuple[str, str | None]:
        tag = f"{os.getpid()}.{secrets.token_hex(4)}"
        stage, target = os.path.join(self.root, f".{top}.tmp.{tag}"), self.path(top)
        aside = None
        try:
            for key, value in group.items():
                path = os.path.join(stage, key.partition("/")[2])
                os.makedirs(os.path.dirname(path), mode=DIR_MODE, exist_ok=True)
                with open_new_private(path) as f:
                    f.write(value)
            if os.path.exists(target):
                aside = os.path.join(self.root, f".{top}.old.{tag}")
                os.rename(target, aside)
            os.rename(stage, target)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            if aside is not None and not os.path.exists(target):
                os.rename(aside, target)  # what was there stays
            raise
        return target, aside

    def put_if_absent(self, key: str, value: bytes, ttl_s: int | None = None) -> bool:
        # a hard link creates the name only if it does not exist: two writers never replace each other
        path = self.path(key)
        tmp = f"{path}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            os.makedirs(os.path.dirname(path), mode=DIR_MODE, exist_ok=True)
            with open_new_private(tmp) as f:
                f.write(value)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        except OSError as e:
            raise BlobStoreError(f"cannot write {path}: {e}") from e
        return True

    def tail(self, key: str, nbytes: int) -> bytes | None:
        try:
            with open(self.path(key), "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - nbytes))
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise BlobStoreError(f"cannot read {self.path(key)}: {e}") from e

    def delete(self, keys: list[str]) -> None:
        for k in keys:
            try:
                os.unlink(self.path(k))
            except FileNotFoundError:
                pass
            except OSError as e:
                raise BlobStoreError(f"cannot delete {self.path(k)}: {e}") from e

    def close(self) -> None:
        """Nothing to release: every operation opens and closes its own file."""


class RedisBlobStore(BlobStore):
    """One Redis string per key, stored as `key_prefix + key`. Every error names the URL redacted."""

    def __init__(self, url: str, key_prefix: str = "", connect_timeout_s: float = 10, timeout_s: float = 30) -> None:
        import redis  # only Redis stores need the client

        self.url = url
        self.where = redact_url(url)
        self.key_prefix = key_prefix
        self._errors = (redis.RedisError, OSError)
        self._r = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s)

    def _fail(self, what: str, e: Exception) -> BlobStoreError:
        return BlobStoreError(f"redis at {self.where}: {what} failed: {redact_url(str(e))}")

    def ping(self) -> None:
        """Fail at start-up, not at first use, when the server cannot be reached."""
        try:
            self._r.ping()
        except self._errors as e:
            raise BlobStoreError(f"redis at {self.where} is unreachable: {redact_url(str(e))}") from e

    def put(self, key: str, value: bytes, ttl_s: int | None = None) -> None:
        self.put_many({key: value}, ttl_s)

    def put_many(self, items: dict[str, bytes], ttl_s: int | None = None) -> None:
        # one round trip in a MULTI: a reader never sees some of the items but not the others
        pipe = self._r.pipeline(transaction=True)
        for key, value in items.items():
            pipe.set(self.key_prefix + key, value, ex=ttl_s)
        try:
            results = pipe.execute()
        except self._errors as e:
            raise self._fail(f"storing {len(items)} key(s)", e) from e
        if not all(results):
            raise BlobStoreError(f"redis at {self.where} refused to store {sorted(items)}")

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        try:
            return list(self._r.mget([self.key_prefix + k for k in keys]))
        except self._errors as e:
            raise self._fail(f"reading {len(keys)} key(s)", e) from e

    def exists(self, keys: list[str]) -> list[bool]:
        pipe = self._r.pipeline(transaction=False)  # one round trip for all keys
        for k in keys:
            pipe.exists(self.key_prefix + k)
        try:
            return [bool(n) for n in pipe.execute()]
        except self._errors as e:
            raise self._fail("exists", e) from e

    def delete(self, keys: list[str]) -> None:
        if not keys:
            return
        try:
            self._r.delete(*[self.key_prefix + k for k in keys])
        except self._errors as e:
            raise self._fail(f"deleting {len(keys)} key(s)", e) from e

    def put_if_absent(self, key: str, value: bytes, ttl_s: int | None = None) -> bool:
        try:
            return bool(self._r.set(self.key_prefix + key, value, ex=ttl_s, nx=True))
        except self._errors as e:
            raise self._fail("storing 1 key", e) from e

    def script(self, source: str) -> Callable[[list[str], list[bytes | str]], object]:
        """A Lua script that Redis runs atomically, over keys given without the prefix."""
        registered = self._r.register_script(source)

        def run(keys: list[str], args: list[bytes | str]) -> object:
            try:
                return registered(keys=[self.key_prefix + k for k in keys], args=args)
            except self._errors as e:
                raise self._fail("a conditional write", e) from e

        return run

    def tail(self, key: str, nbytes: int) -> bytes | None:
        try:
            pipe = self._r.pipeline(transaction=False)
            pipe.exists(self.key_prefix + key)
            pipe.getrange(self.key_prefix + key, -nbytes, -1)
            present, data = pipe.execute()
        except self._errors as e:
            raise self._fail("reading 1 key", e) from e
        return bytes(data) if present else None

    def close(self) -> None:
        self._r.close()
