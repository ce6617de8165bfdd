"""The R3 p2pstore in Redis (`p2pstore_url: redis://...`): `.npy` bytes under `{namespace}/` keys."""

from __future__ import annotations

from fastdeploy_r3.blobstore.base import BlobStoreError
from fastdeploy_r3.blobstore.redis import RedisBlobStore
from fastdeploy_r3.r3.rollout_id import validate_namespace
from fastdeploy_r3.r3.stores.base import RoutingStore, RoutingStoreError


class RedisRoutingStore(RoutingStore):
    """Redis keys `{namespace}/{rid}[/layer_{layer}]` holding `.npy` bytes, each expiring after `ttl_s`."""

    def __init__(
        self,
        url: str,
        namespace: str,
        ttl_s: int = 3600,
        use_fused_put: bool = True,
        only_last_turn: bool = False,
        timeout_s: float = 30.0,
    ) -> None:
        self.namespace = validate_namespace(namespace)
        blobs = RedisBlobStore(url, f"{self.namespace}/", connect_timeout_s=min(10.0, timeout_s), timeout_s=timeout_s)
        super().__init__(blobs, int(ttl_s), use_fused_put, only_last_turn, blobs.where)
        self._redis_blobs = blobs

    def fused_key(self, rid: str) -> str:
        return rid

    def meta_key(self, rid: str) -> str:
        return f"{rid}#meta"  # "#" is in no rollout id: no entry of another rollout can be named so

    def layer_key(self, rid: str, layer: int) -> str:
        return f"{rid}/layer_{layer}"

    def entry_name(self, key: str) -> str:
        return self._redis_blobs.key_prefix + key

    def ping(self) -> None:
        """Fail at start-up, not at the first rollout, when the store cannot be reached."""
        try:
            self._redis_blobs.ping()
        except BlobStoreError as e:
            raise RoutingStoreError(f"cannot reach the R3 p2pstore: {e}") from e
