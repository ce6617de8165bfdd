"""The R3 p2pstore in Mooncake (`p2pstore_url: mooncake://...`): a RoutingStore over MooncakeBlobStore.

    key_style=fdr3        {namespace}/{rid}   /  {namespace}/{rid}/layer_{layer}   (as in Redis)
    key_style=fastdeploy  {rid}               /  {rid}_{layer}                     (FastDeploy's key names)

Values are the `.npy` bytes every store holds, followed by an xxh3_64 (ChecksummedBlobStore): a
Mooncake object can be cut short or lost under its reader, and R3 must fail closed, so a flipped or
short value is a RoutedExpertsDecodeError naming the key, never ids. Objects are hard-pinned (never
evicted) until only_last_turn or a trainer (`release`) deletes them, or until the client whose segment
holds them leaves; Mooncake has no expiry, so `ttl_s` does not apply. With `key_style=fastdeploy`
there is no namespace: the cluster belongs to one deployment. `rid` is the rollout id, or
`{rollout_id}#{i}` for choice i (r3/rollout_id.py), so a layer key `{rid}_{layer}` is never a choice's.
"""

from __future__ import annotations

from fastdeploy_r3.blobstore.base import BlobStoreError, ChecksummedBlobStore, redact_url
from fastdeploy_r3.blobstore.mooncake import MooncakeBlobStore, MooncakeURL
from fastdeploy_r3.r3.rollout_id import choice_rollout_id, validate_namespace, validate_rollout_id
from fastdeploy_r3.r3.stores.base import RoutingStore, RoutingStoreError


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
        self.namespace = validate_namespace(namespace)
        where = redact_url(url)
        try:
            parsed = MooncakeURL.parse(url)
            raw = MooncakeBlobStore(parsed, pin=True, segment_bytes=segment_bytes)
        except BlobStoreError as e:
            raise RoutingStoreError(f"R3 p2pstore {where}: {e}") from e
        self.key_style = parsed.key_style
        super().__init__(ChecksummedBlobStore(raw), None, use_fused_put, only_last_turn, where)

    def fused_key(self, rid: str) -> str:
        return rid if self.key_style == "fastdeploy" else f"{self.namespace}/{rid}"

    def layer_key(self, rid: str, layer: int) -> str:
        return f"{rid}_{layer}" if self.key_style == "fastdeploy" else f"{self.namespace}/{rid}/layer_{layer}"

    def meta_key(self, rid: str) -> str:
        return f"{self.fused_key(rid)}#meta"  # "#" and a word: never a rollout's or a choice's (#digits) key

    def entry_name(self, key: str) -> str:
        return key

    def release(self, rollout_id: str, choice: int | None = None, moe_layer_ids: list[int] | None = None) -> None:
        """Delete one choice's R3 once a trainer has read it (fused, or these layers' entries)."""
        validate_rollout_id(rollout_id)
        rid = choice_rollout_id(rollout_id, choice)
        keys = [self.fused_key(rid)] if moe_layer_ids is None else [self.layer_key(rid, x) for x in moe_layer_ids]
        try:
            self.blobs.delete(keys)
        except BlobStoreError as e:
            raise RoutingStoreError(f"releasing R3 of rollout {rid!r} in {self.where} failed: {e}") from e
