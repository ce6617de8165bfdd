"""Mooncake Store as the KV storage tier (`--kv-storage mooncake://...`) and as the R3 p2pstore.

Both adapt one `MooncakeStore` client to today's bases (`KVStorageBackend`, `RoutingStore`):

    KV tier   fdr3:kv:{namespace prefix}:{block hash}   evictable: a lost block is recomputed
    R3 fdr3   {namespace}:{rid}  /  {namespace}:{rid}:{layer}          hard-pinned until deleted
    R3 fastdeploy  {rid}  /  {rid}_{layer}   (URL `key_style=fastdeploy`: FastDeploy's key names)

Values are `.npy` bytes for R3 (fused `[L, T, K]` or per layer `[T, K]`, as in Redis) and block
blobs for KV, each framed with a checksum by the client. Mooncake has no expiry: `ttl_s` does not
apply; R3 objects stay until only_last_turn or a trainer (`release`) deletes them, or until the
client holding them leaves. With `key_style=fastdeploy` there is no namespace: the Mooncake cluster
belongs to one deployment, and `{rid}_{layer}` cannot be told from choice `_{i}` of a fused put, so
a deployment writes either fused or per layer, never both.
"""

from __future__ import annotations

import logging

import numpy as np

from fastdeploy_r3.cache_manager.mooncake_store import (
    MooncakeCorruptObjectError,
    MooncakeError,
    MooncakeStore,
    MooncakeURL,
)
from fastdeploy_r3.cache_manager.routing_store import (
    RoutedExpertsDecodeError,
    RoutingStore,
    RoutingStoreError,
    any_n_rollout_ids,
    choice_rollout_id,
    load_npy,
    npy_bytes,
    redact_url,
    validate_rollout_id,
)
from fastdeploy_r3.cache_manager.storage import KVStorageBackend, StorageError, namespace_prefix, validate_key

logger = logging.getLogger(__name__)


class MooncakeStorageBackend(KVStorageBackend):
    """`mooncake://master:port?...`: one object per block; missing, evicted, lost or corrupt is a miss."""

    def __init__(self, url: str, namespace: str) -> None:
        self.prefix = f"fdr3:kv:{namespace_prefix(namespace)}:"
        try:
            self._store = MooncakeStore(url, pin=False)
        except MooncakeError as e:
            raise StorageError(f"KV storage {url}: {e}") from e

    def mooncake_key(self, key: str) -> str:
        return self.prefix + validate_key(key)

    def put(self, key: str, value: bytes) -> None:
        try:
            self._store.put(self.mooncake_key(key), value)
        except MooncakeError as e:
            raise StorageError(f"mooncake: cannot store block {key}: {e}") from e

    def get(self, key: str) -> bytes | None:
        try:
            return self._store.get(self.mooncake_key(key))
        except MooncakeCorruptObjectError as e:
            logger.warning("mooncake storage: %s (treated as a miss)", e)
            return None

    def exists(self, keys: list[str]) -> list[bool]:
        return self._store.exists([self.mooncake_key(k) for k in keys])

    def delete(self, keys: list[str]) -> None:
        # force: a block read in the last seconds holds a lease; a reader racing this delete fails its checksum
        self._store.delete([self.mooncake_key(k) for k in keys], force=True)

    def close(self) -> None:
        self._store.close()


class MooncakeRoutingStore(RoutingStore):
    """R3 in Mooncake under fdr3 or FastDeploy keys, hard-pinned unless the URL says `pin=0`.

    `segment_bytes=0` makes a client that stores nothing itself (a trainer's reader).
    """

    def __init__(
        self,
        url: str,
        namespace: str,
        use_fused_put: bool = True,
        only_last_turn: bool = False,
        segment_bytes: int | None = None,
    ) -> None:
        super().__init__(use_fused_put, only_last_turn)
        self.url = url
        self.namespace = validate_rollout_id(namespace, "namespace")
        try:
            parsed = MooncakeURL.parse(url)
            self.key_style = parsed.key_style
            self._store = MooncakeStore(parsed, pin=True, segment_bytes=segment_bytes)
        except MooncakeError as e:
            raise RoutingStoreError(f"R3 p2pstore {redact_url(url)}: {e}") from e

    def key(self, rid: str, layer: int | None = None) -> str:
        if self.key_style == "fastdeploy":
            return rid if layer is None else f"{rid}_{layer}"
        return f"{self.namespace}:{rid}" if layer is None else f"{self.namespace}:{rid}:{layer}"

    def _read(self, keys: list[str]) -> list[np.ndarray]:
        try:
            values = self._store.get_many(keys)
        except MooncakeCorruptObjectError as e:
            raise RoutedExpertsDecodeError(f"R3 in {redact_url(self.url)}: {e}") from e
        missing = [k for k, v in zip(keys, values, strict=True) if v is None]
        if missing:
            raise KeyError(f"no R3 under keys {missing} (never written, deleted, or lost with the client holding it)")
        return [load_npy(v, k) for k, v in zip(keys, values, strict=True)]

    def _get(self, rid: str, moe_layer_ids: list[int] | None) -> np.ndarray:
        if moe_layer_ids is None:
            (fused,) = self._read([self.key(rid)])
            return np.ascontiguousarray(fused.transpose(1, 0, 2))  # [L, T, K] -> [T, L, K]
        return np.stack(self._read([self.key(rid, layer) for layer in moe_layer_ids]), axis=1)  # [T, L, K]

    def _put(self, rollout_id: str, routed_experts: list[np.ndarray], moe_layer_ids: list[int]) -> list[str]:
        n = len(routed_experts)
        items: list[tuple[str, bytes]] = []
        for i, arr in enumerate(routed_experts):
            rid = choice_rollout_id(rollout_id, i, n)
            if self.use_fused_put:
                items.append((self.key(rid), npy_bytes(arr.transpose(1, 0, 2))))  # [L, T, K]
            else:
                items.extend((self.key(rid, layer), npy_bytes(arr[:, j, :])) for j, layer in enumerate(moe_layer_ids))
        try:
            # one batch; no transaction in Mooncake, so a refused batch is taken back whole by put_many
            self._store.put_many(items)
        except MooncakeError as e:
            where = redact_url(self.url)
            raise RoutingStoreError(f"storing R3 of rollout {rollout_id!r} in {where} failed: {e}") from e
        return [key for key, _ in items]

    def _delete(self, rollout_id: str, moe_layer_ids: list[int]) -> None:
        keys = []
        for rid in any_n_rollout_ids(rollout_id):
            keys.append(self.key(rid))
            keys.extend(self.key(rid, layer) for layer in moe_layer_ids)
        left = self._store.delete(keys, force=True)
        if left:
            raise RoutingStoreError(f"deleting R3 of previous turn {rollout_id!r} failed for {left}")

    def release(self, rollout_id: str, choice: int | None = None, moe_layer_ids: list[int] | None = None) -> None:
        """Delete one choice's R3 after a trainer has read it (force: the reader's lease is its own)."""
        validate_rollout_id(rollout_id)
        rid = rollout_id if choice is None else f"{rollout_id}_{choice}"
        keys = [self.key(rid)] if moe_layer_ids is None else [self.key(rid, layer) for layer in moe_layer_ids]
        left = self._store.delete(keys, force=True)
        if left:
            raise RoutingStoreError(f"releasing R3 of rollout {rid!r} failed for {left}")

    def read_raw(self, key: str) -> bytes | None:
        """The object under `key` as stored (no trailer check): for arrays FastDeploy itself put."""
        return self._store.get_raw(key)

    def close(self) -> None:
        self._store.close()
