"""Routing stores: where R3 goes when it is not returned in the response (DESIGN.md §7).

One put per finished request, with one `[T, L, K]` array per choice, on a BlobStore
(blobstore/base.py):

    local      {local_store_dir}/{rid}.npy                       fused  [L, T, K]
               {local_store_dir}/{rid}.layers/layer_{layer}.npy  per layer [T, K]
               {local_store_dir}/{rollout_id}#meta.json          weight version(s), layout (JSON)
    p2pstore   {namespace}/{rid}                                 fused  [L, T, K]  (.npy bytes)
               {namespace}/{rid}/layer_{layer}                   per layer [T, K]
               {namespace}/{rollout_id}#meta                     weight version(s), layout (JSON)
               (Mooncake, key_style=fastdeploy: {rid} / {rid}_{layer}; see r3/stores/mooncake.py)

`rid` is the rollout id, or `{rollout_id}#{i}` for choice i of a request with n > 1 (r3/rollout_id.py);
`layer` is the model's layer index (an entry of `moe_layer_ids`, or of every layer in the `all_layers`
layout: then the fused entry is [num_hidden_layers, T, K] too), not the position among the MoE layers.
Values are plain `.npy` files, without a checksum trailer, because trainers `np.load` them (Mooncake's
are the exception: see r3/stores/mooncake.py).

Keys cannot run into each other (issue 11, F6/F7): a rollout id holds neither `/` nor `#`, a namespace
neither `/` nor `:`, so `{namespace}/` is one deployment's and never the KV tier's (`fdr3:kv:...`),
a fused key has one `/` where a layer key has two, a choice id (`#` and digits) is never a plain rollout id
nor a meta entry (`#meta`). In a
local directory a fused file ends in `.npy`, a per-layer directory in `.layers`, so neither is
another rollout's.

Contract: `put` returns only when every array is durable in the store (the caller answers the
request afterwards, so a trainer never looks for a key that is not there); it raises
`RoutingStoreError` otherwise. Stores are never wiped at start: other deployments and earlier
rollouts may share them. A backend is a BlobStore and a key scheme: Mooncake's is r3/stores/mooncake.py.
"""

from __future__ import annotations

import abc
import json
from typing import Any

import numpy as np

from fastdeploy_r3.blobstore.base import BlobStore, BlobStoreError, ChecksumError
from fastdeploy_r3.r3.codec import RoutedExpertsDecodeError, load_npy, npy_bytes
from fastdeploy_r3.r3.rollout_id import (
    any_n_rollout_ids,
    choice_rollout_id,
    previous_turn_rollout_id,
    validate_rollout_id,
)


class RoutingStoreError(RuntimeError):
    """A put or delete did not complete; the request must fail rather than leave a missing key."""


class RoutingStore(abc.ABC):
    """Stores the R3 arrays of finished requests under their rollout ids, in a BlobStore."""

    def __init__(
        self, blobs: BlobStore, ttl_s: int | None, use_fused_put: bool, only_last_turn: bool, where: str
    ) -> None:
        self.blobs = blobs
        self.ttl_s = ttl_s
        self.use_fused_put = use_fused_put
        self.only_last_turn = only_last_turn
        self.where = where  # for messages; never holds a password

    # -- key scheme (per store) ---------------------------------------------------------------------

    @abc.abstractmethod
    def fused_key(self, rid: str) -> str: ...

    @abc.abstractmethod
    def layer_key(self, rid: str, layer: int) -> str: ...

    @abc.abstractmethod
    def meta_key(self, rid: str) -> str: ...

    @abc.abstractmethod
    def entry_name(self, key: str) -> str:
        """What a reader outside this class calls the entry of a key: a file path, a full Redis key."""

    def stored_layers(self, rid: str) -> list[int]:
        """Layers stored per layer for rid, when the reader did not say which; [] where it cannot be listed."""
        return []

    # -- operations ---------------------------------------------------------------------------------

    def put(
        self,
        rollout_id: str,
        routed_experts: list[np.ndarray],
        moe_layer_ids: list[int],
        meta: dict[str, Any] | None = None,
    ) -> list[str]:
        """Store one `[T, L, K]` array per choice; returns the entries written (paths or full keys).

        `meta` (JSON) goes to the rollout's meta entry in the same put: the weight version(s) that
        produced it and its layout (`get_meta` reads it back).

        Blocking (disk or network): call it off the event loop. With `only_last_turn`, the previous
        turn's entries of a `data:gen:turn:segment` id are deleted once the new ones are in.
        """
        validate_rollout_id(rollout_id)
        if not routed_experts:
            raise RoutingStoreError("put() needs at least one choice")
        items: dict[str, bytes] = {}
        for i, arr in enumerate(routed_experts):
            if arr.ndim != 3 or arr.shape[1] != len(moe_layer_ids):
                raise RoutingStoreError(
                    f"choice {i}: routed_experts has shape {arr.shape}; expected [T, {len(moe_layer_ids)}, K]"
                )
            rid = choice_rollout_id(rollout_id, i if len(routed_experts) > 1 else None)
            if self.use_fused_put:
                items[self.fused_key(rid)] = npy_bytes(arr.transpose(1, 0, 2))  # [L, T, K]
            else:
                for j, layer in enumerate(moe_layer_ids):
                    items[self.layer_key(rid, layer)] = npy_bytes(arr[:, j, :])  # [T, K]
        if meta is not None:
            items[self.meta_key(rollout_id)] = json.dumps(meta, sort_keys=True).encode()
        try:
            self.blobs.put_many(items, self.ttl_s)
        except BlobStoreError as e:
            raise RoutingStoreError(f"storing R3 of rollout {rollout_id!r} in {self.where} failed: {e}") from e
        if self.only_last_turn:
            prev = previous_turn_rollout_id(rollout_id)
            if prev is not None:
                self.delete(prev, moe_layer_ids)
        return [self.entry_name(k) for k in items]

    def get(self, rollout_id: str, choice: int | None = None, moe_layer_ids: list[int] | None = None) -> np.ndarray:
        """Read one choice back as `[T, L, K]` (the trainer side).

        `choice`: the index of a choice of a request made with n > 1. `moe_layer_ids`: read the per-layer
        entries of these layers, in this order; None reads the fused entry (local: falls back to all
        per-layer files found). Raises KeyError when the rollout is not there.
        """
        validate_rollout_id(rollout_id)
        rid = choice_rollout_id(rollout_id, choice)
        if moe_layer_ids is None:
            data = self._read([self.fused_key(rid)])[0]
            if data is not None:
                return np.ascontiguousarray(load_npy(data, self.fused_key(rid)).transpose(1, 0, 2))  # [T, L, K]
            moe_layer_ids = self.stored_layers(rid)
            if not moe_layer_ids:
                raise KeyError(f"no R3 for rollout {rid!r} in {self.where}: no {self.fused_key(rid)!r} and no "
                               "per-layer entries found (expired, lost with the client that held it, or stored "
                               "per layer: pass moe_layer_ids)")
        keys = [self.layer_key(rid, layer) for layer in moe_layer_ids]
        values = self._read(keys)
        missing = [k for k, v in zip(keys, values, strict=True) if v is None]
        if missing:
            raise KeyError(f"no R3 for rollout {rid!r} in {self.where} under {missing}")
        return np.stack([load_npy(v, k) for k, v in zip(keys, values, strict=True)], axis=1)  # [T, L, K]

    def contains(self, rollout_id: str, moe_layer_ids: list[int]) -> bool:
        """Whether any put(rollout_id, ...) left entries here, whatever its n (fused, or per layer: a
        per-layer put writes every layer or fails, so its first layer stands for it)."""
        validate_rollout_id(rollout_id)
        keys = []
        for rid in any_n_rollout_ids(rollout_id):
            keys.append(self.fused_key(rid))
            if moe_layer_ids:
                keys.append(self.layer_key(rid, moe_layer_ids[0]))
        try:
            return any(self.blobs.exists(keys))
        except BlobStoreError as e:
            raise RoutingStoreError(f"cannot tell whether rollout {rollout_id!r} is stored: {e}") from e

    def _read(self, keys: list[str]) -> list[bytes | None]:
        try:
            return self.blobs.get_many(keys)
        except ChecksumError as e:  # a store that checksums its values (Mooncake) found a corrupt one
            raise RoutedExpertsDecodeError(f"R3 in {self.where}: {e}") from e

    def get_meta(self, rollout_id: str) -> dict[str, Any]:
        """The meta entry of a rollout (weight_version, weight_versions per choice, routing_layout,
        layer_ids); KeyError when there is none."""
        validate_rollout_id(rollout_id)
        data = self.blobs.get(self.meta_key(rollout_id))
        if data is None:
            raise KeyError(f"no R3 meta entry for rollout {rollout_id!r} in {self.where}")
        return json.loads(data)

    def delete(self, rollout_id: str, moe_layer_ids: list[int]) -> None:
        """Remove what any put(rollout_id, ...) wrote, fused or per layer, whatever its number of choices."""
        keys = [self.meta_key(rollout_id)]
        for rid in any_n_rollout_ids(rollout_id):
            keys.append(self.fused_key(rid))
            keys.extend(self.layer_key(rid, layer) for layer in moe_layer_ids)
        try:
            self.blobs.delete(keys)
        except BlobStoreError as e:
            raise RoutingStoreError(f"deleting R3 of rollout {rollout_id!r} in {self.where} failed: {e}") from e

    def ping(self) -> None:  # noqa: B027 - optional: a store with nothing to check answers by not raising
        """Raise RoutingStoreError when the store cannot take a put now (unreachable, read-only, full)."""

    def close(self) -> None:
        """Release connections; the stored data stays."""
        self.blobs.close()
