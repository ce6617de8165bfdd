"""The R3 p2pstore in Redis (`p2pstore_url: redis://...`): `.npy` bytes under `{namespace}/` keys."""

from __future__ import annotations

from fastdeploy_r3.blobstore.base import BlobStoreError
from fastdeploy_r3.blobstore.redis import RedisBlobStore
from fastdeploy_r3.r3.reservation import REDIS_CONDITIONAL_PUT, Reservation, ReservationLostError, RolloutExistsError
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
        self._conditional_put = blobs.script(REDIS_CONDITIONAL_PUT)

    def _write(
        self, rollout_id: str, items: dict[str, bytes], stale: list[str], moe_layer_ids: list[int],
        overwrite: bool, reservation: Reservation | None,
    ) -> None:  # fmt: skip
        """One Lua script: the lock's token, the create-only check, the stale deletes and the new values
        happen at once, so no reader or writer ever sees a mix of two rollouts."""
        present = self.presence_keys(rollout_id, moe_layer_ids)
        keys = [self.lock_key(rollout_id), *present, *stale, *items]
        args = [reservation.token if reservation else "", "1" if overwrite else "0", str(self.ttl_s),
                str(len(present)), str(len(stale)), *items.values()]  # fmt: skip
        answer = self._conditional_put(keys, args)
        if answer == b"lost":
            raise ReservationLostError(f"rollout id {rollout_id!r} was taken by another writer while this request "
                                       "ran (its reservation expired); its R3 is not stored")
        if answer == b"exists":
            raise RolloutExistsError(f"rollout id {rollout_id!r} already has routed_experts in the store")

    def fused_key(self, rid: str) -> str:
        return rid

    def meta_key(self, rid: str) -> str:
        return f"{rid}#meta"  # "#" is in no rollout id: no entry of another rollout can be named so

    def layer_key(self, rid: str, layer: int) -> str:
        return f"{rid}/layer_{layer}"

    def lock_key(self, rollout_id: str) -> str:
        return f"{rollout_id}#lock"

    def entry_name(self, key: str) -> str:
        return self._redis_blobs.key_prefix + key

    def ping(self) -> None:
        """Fail at start-up, not at the first rollout, when the store cannot be reached."""
        try:
            self._redis_blobs.ping()
        except BlobStoreError as e:
            raise RoutingStoreError(f"cannot reach the R3 p2pstore: {e}") from e
