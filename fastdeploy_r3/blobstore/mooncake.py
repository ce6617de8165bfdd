"""Mooncake Store as a BlobStore (blobstore/base.py): the third backend beside the local directory and Redis.

Mooncake Store (`mooncake-transfer-engine`, `pip install fastdeploy_r3[mooncake]`) keeps objects in
memory segments that its clients contribute; a master (`mooncake_master`) only holds metadata:

    mooncake_master  ── where each key lives, leases, eviction
         │
    client A (this engine's process, contributes `segment` bytes)     objects of A's segment vanish
    client B (a `mooncake_client` holder, contributes its segment)    when A exits; B's outlive A

Behaviour measured on 0.3.13.post1 that this class turns into a plain contract:
- `get` of a missing key returns b"" (no exception); an object whose owner was killed still "exists"
  for `client_ttl` seconds but reads as b"". Both are a miss here (None).
- `put` of an existing key keeps the old value; `upsert` replaces it. Every write here is an upsert,
  so a reused key (a rollout id run twice) never serves the previous value.
- Objects are evicted silently when segments fill up, unless put with a hard pin; a put into full
  segments fails (non-zero return). Evicted is a miss.
- An object just read holds a lease (`default_kv_lease_ttl`, 10 s) and `remove` refuses it unless
  `force`.

Values are stored as they are given, as LocalBlobStore and RedisBlobStore store them: integrity is
the caller's, through base.checksummed (the KV block codec ends every block with it; the
Mooncake R3 store wraps its values in ChecksummedBlobStore). So FastDeploy's bare arrays read back
with a plain `get`.

URL: `mooncake://MASTER_HOST:PORT?metadata=P2PHANDSHAKE&protocol=tcp&segment=256MB&buffer=64MB
&pin=0|1&key_style=fdr3|fastdeploy&device=&local_host=127.0.0.1`.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from dataclasses import dataclass, replace
from urllib.parse import parse_qs, urlparse

from fastdeploy_r3.blobstore.base import BlobStore, BlobStoreError

_SIZE_RE = re.compile(r"^(\d+)\s*(B|KB|MB|GB|KiB|MiB|GiB)?$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 2**10, "kib": 2**10, "mb": 2**20, "mib": 2**20, "gb": 2**30, "gib": 2**30}
_LOOPBACK = ("127.0.0.1", "localhost")
_KEY_STYLES = ("fdr3", "fastdeploy")
_OBJECT_NOT_FOUND = -704  # ErrorCode::OBJECT_NOT_FOUND of mooncake-store


class MooncakeError(BlobStoreError):
    """The Mooncake store cannot be used (bad URL, package missing, master unreachable, write refused)."""


def parse_size(text: str, what: str) -> int:
    """`"256MB"`, `"64MiB"`, `"1GB"` or a byte count -> bytes (KB/MB/GB are binary units, as Mooncake's)."""
    m = _SIZE_RE.match(text.strip())
    if m is None:
        raise MooncakeError(f"{what}={text!r} is not a size; write bytes or e.g. 256MB, 1GB")
    return int(m.group(1)) * _UNITS[(m.group(2) or "").lower()]


@dataclass(frozen=True)
class MooncakeURL:
    """The parsed `mooncake://` URL of a deployment."""

    master: str  # host:port of mooncake_master's RPC service
    metadata: str = "P2PHANDSHAKE"  # transfer-engine metadata: P2PHANDSHAKE, or an etcd/http server
    protocol: str = "tcp"  # tcp or rdma
    device: str = ""  # RDMA device names (rdma only)
    segment_bytes: int = 256 * 2**20  # memory this process contributes; 0 = store only in other clients
    buffer_bytes: int = 64 * 2**20  # local transfer buffer; bounds the largest single object
    pin: bool | None = None  # hard-pin every put (never evicted); None = the user's default
    key_style: str = "fdr3"  # R3 keys: fdr3 = {namespace}/{rid}[/layer_{layer}], fastdeploy = {rid}[_{layer}]
    local_host: str = ""  # address this client's transfer engine advertises; "" = derived from master

    @classmethod
    def parse(cls, url: str) -> MooncakeURL:
        parsed = urlparse(url)
        if parsed.scheme != "mooncake" or not parsed.hostname or parsed.port is None:
            raise MooncakeError(
                f"Mooncake URL {url!r} needs a master address; use "
                "mooncake://127.0.0.1:50051?metadata=P2PHANDSHAKE&protocol=tcp"
            )
        known = {"metadata", "protocol", "device", "segment", "buffer", "pin", "key_style", "local_host"}
        query = {k: v[-1] for k, v in parse_qs(parsed.query, keep_blank_values=True).items()}
        unknown = sorted(set(query) - known)
        if unknown:
            raise MooncakeError(f"Mooncake URL {url!r}: unknown parameter(s) {unknown}; known: {sorted(known)}")
        out = cls(master=f"{parsed.hostname}:{parsed.port}")
        if "metadata" in query:
            out = replace(out, metadata=query["metadata"])
        if "protocol" in query:
            if query["protocol"] not in ("tcp", "rdma"):
                raise MooncakeError(f"Mooncake URL {url!r}: protocol={query['protocol']!r}; use tcp or rdma")
            out = replace(out, protocol=query["protocol"])
        if "device" in query:
            out = replace(out, device=query["device"])
        if "segment" in query:
            segment = parse_size(query["segment"], "segment")
            if 0 < segment < 16 * 2**20:
                raise MooncakeError(f"Mooncake URL {url!r}: segment={query['segment']}; use 0 or at least 16MB")
            out = replace(out, segment_bytes=segment)
        if "buffer" in query:
            out = replace(out, buffer_bytes=parse_size(query["buffer"], "buffer"))
        if "pin" in query:
            if query["pin"] not in ("0", "1"):
                raise MooncakeError(f"Mooncake URL {url!r}: pin={query['pin']!r}; use pin=1 (hard pin) or pin=0")
            out = replace(out, pin=query["pin"] == "1")
        if "key_style" in query:
            if query["key_style"] not in _KEY_STYLES:
                raise MooncakeError(f"Mooncake URL {url!r}: key_style={query['key_style']!r}; use one of {_KEY_STYLES}")
            out = replace(out, key_style=query["key_style"])
        if "local_host" in query:
            out = replace(out, local_host=query["local_host"])
        return out

    @property
    def advertised_host(self) -> str:
        """The local address: 127.0.0.1 next to a loopback master, else this host's name."""
        if self.local_host:
            return self.local_host
        host = self.master.rsplit(":", 1)[0]
        return "127.0.0.1" if host in _LOOPBACK else os.uname().nodename


class MooncakeBlobStore(BlobStore):
    """One `MooncakeDistributedStore` client of this process, as a BlobStore.

    `pin` is the default hard pin of puts (the URL's `pin=` overrides it): a KV tier leaves objects
    evictable (a miss costs a recompute), an R3 store pins what a trainer has not read yet. Mooncake
    has no expiry, so `ttl_s` does not apply. `segment_bytes` overrides the URL's segment: 0 makes a
    client that stores nothing itself (the engine's lookup client, a trainer's reader).
    Thread-safe: the API server delivers R3 from several threads through one client.
    """

    def __init__(self, url: str | MooncakeURL, pin: bool = False, segment_bytes: int | None = None) -> None:
        self.url = url if isinstance(url, MooncakeURL) else MooncakeURL.parse(url)
        self.pin = pin if self.url.pin is None else self.url.pin
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as e:
            raise MooncakeError(
                f"the Mooncake client is not installed ({e}); run `pip install fastdeploy_r3[mooncake]` "
                "and `apt-get install -y libibverbs1`"
            ) from e
        host = self.url.advertised_host
        if host in _LOOPBACK:
            # The TCP transport otherwise binds and advertises the first NIC, unreachable on a loopback deployment.
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        self._config = ReplicateConfig()
        self._config.with_hard_pin = self.pin
        self._lock = threading.Lock()
        master_host, master_port = self.url.master.rsplit(":", 1)
        try:
            # setup() retries an absent master for about 90 s; fail in seconds instead.
            socket.create_connection((master_host, int(master_port)), timeout=5).close()
        except OSError as e:
            raise MooncakeError(
                f"mooncake_master at {self.url.master} is unreachable ({e}); start it or fix the URL"
            ) from e
        self._store = MooncakeDistributedStore()
        segment = self.url.segment_bytes if segment_bytes is None else segment_bytes
        rc = self._store.setup(
            host, self.url.metadata, segment, self.url.buffer_bytes, self.url.protocol, self.url.device,
            self.url.master,
        )  # fmt: skip
        if rc != 0 or self._store.health_check() != 0:
            raise MooncakeError(
                f"cannot join the Mooncake store at {self.url.master} (setup returned {rc}); start mooncake_master "
                f"there or fix the URL"
            )
        self._closed = False

    def put(self, key: str, value: bytes | memoryview, ttl_s: int | None = None) -> None:
        """Store `value` under `key`, replacing any previous value; raises MooncakeError when not stored."""
        self.put_many({key: value}, ttl_s)

    def put_many(self, items: dict[str, bytes | memoryview], ttl_s: int | None = None) -> None:
        """All items in one batch (an upsert: a reused key never serves its old value); on failure none is left."""
        if not items:
            return
        keys = list(items)
        data = [bytes(v) for v in items.values()]
        too_big = [k for k, d in zip(keys, data, strict=True) if len(d) > self.url.buffer_bytes]
        if too_big:
            raise MooncakeError(
                f"object(s) {too_big} exceed the transfer buffer of {self.url.buffer_bytes} bytes; "
                "raise buffer= in the Mooncake URL"
            )
        with self._lock:
            rc = self._store.upsert_batch(keys, data, self._config)
        if rc != 0:
            # no transaction in Mooncake: take back whatever part of the batch landed
            self.delete(keys)
            raise MooncakeError(f"Mooncake refused the batch {keys}: error {rc} (segments full?)")

    def put_if_absent(self, key: str, value: bytes | memoryview, ttl_s: int | None = None) -> bool:
        """Mooncake's own put keeps the value of an existing key, and the master admits one put per key:
        a key already there is not ours; otherwise reading back whose value is there says who won a race
        (values must be unique to their writer)."""
        data = bytes(value)
        with self._lock:
            if self._store.is_exist(key) == 1:
                return False
            self._store.put(key, data, self._config)
        return self.get(key) == data

    def get(self, key: str) -> bytes | None:
        """The value, or None when missing, evicted or lost with the client whose segment held it."""
        with self._lock:
            data = self._store.get(key)
        return data if data else None

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        with self._lock:
            values = self._store.get_batch(list(keys))
        return [v if v else None for v in values]

    def exists(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        with self._lock:
            found = self._store.batch_is_exist(list(keys))
        return [r == 1 for r in found]

    def delete(self, keys: list[str]) -> None:
        """Remove `keys`, with `force`: an object read in the last seconds holds a lease that would refuse it
        (a reader racing the delete gets a miss). A key that is not there is fine."""
        if not keys:
            return
        with self._lock:
            results = self._store.batch_remove(list(keys), True)
        left = [k for k, rc in zip(keys, results, strict=True) if rc not in (0, _OBJECT_NOT_FOUND)]
        if left:
            raise MooncakeError(f"Mooncake did not remove {left}: error(s) {sorted(set(results) - {0})}")

    def close(self) -> None:
        """Leave the store; objects in this client's segment go with it."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._store.close()
