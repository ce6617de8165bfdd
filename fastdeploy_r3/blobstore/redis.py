"""RedisBlobStore: one Redis string per key under a prefix; errors never show the URL's password."""

from __future__ import annotations

from fastdeploy_r3.blobstore.base import BlobStore, BlobStoreError, redact_url


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
