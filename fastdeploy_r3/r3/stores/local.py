"""The R3 store in a local directory (`routing_store_type: local`): `.npy` files a trainer can np.load."""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from fastdeploy_r3.blobstore.disk_budget import DiskBudget
from fastdeploy_r3.blobstore.local import LocalBlobStore
from fastdeploy_r3.r3.rollout_id import any_n_rollout_ids, choice_rollout_id
from fastdeploy_r3.r3.stores.base import RoutingStore, RoutingStoreError


class LocalRoutingStore(RoutingStore):
    """`.npy` files under one directory; every file appears whole (temp file + rename), and the files of
    a per-layer rollout appear together (LocalBlobStore.put_many). Bounded, when asked, by a DiskBudget:
    a rollout older than `ttl_s` is gone, and past `capacity_bytes` the least recently used rollouts go
    first, each removed whole."""

    def __init__(self, root: str, use_fused_put: bool = True, only_last_turn: bool = False,
                 ttl_s: int | None = None, capacity_bytes: int | None = None) -> None:  # fmt: skip
        blobs = LocalBlobStore(root)
        super().__init__(blobs, None, use_fused_put, only_last_turn, blobs.root)
        self.root = blobs.root
        self._local = blobs
        self.budget = DiskBudget(self.root, capacity_bytes, ttl_s, whole_dirs=True)

    def put(
        self,
        rollout_id: str,
        routed_experts: list[np.ndarray],
        moe_layer_ids: list[int],
        meta: dict[str, Any] | None = None,
    ) -> list[str]:
        try:
            self.budget.admit(sum(a.nbytes + 128 for a in routed_experts))  # + .npy headers
        except OSError as e:
            raise RoutingStoreError(f"cannot make room for rollout {rollout_id!r} under {self.root}: {e}") from e
        return super().put(rollout_id, routed_experts, moe_layer_ids, meta)

    def _entries(self, rid: str) -> tuple[str, str]:
        """The fused file and the per-layer directory of one stored choice."""
        return self._local.path(self.fused_key(rid)), self._local.path(f"{rid}.layers")

    def get(self, rollout_id: str, choice: int | None = None, moe_layer_ids: list[int] | None = None) -> np.ndarray:
        rid = choice_rollout_id(rollout_id, choice)
        for entry in self._entries(rid):
            if self.budget.expired(entry):
                raise KeyError(f"R3 of rollout {rid!r} under {self.root} expired (older than ttl_s)")
        arr = super().get(rollout_id, choice, moe_layer_ids)
        for entry in self._entries(rid):
            self.budget.touch(entry)
        return arr

    def fused_key(self, rid: str) -> str:
        return f"{rid}.npy"

    def meta_key(self, rid: str) -> str:
        return f"{rid}#meta.json"  # "#" is in no rollout id: no entry of another rollout can be named so

    def layer_key(self, rid: str, layer: int) -> str:
        return os.path.join(f"{rid}.layers", f"layer_{layer}.npy")

    def entry_name(self, key: str) -> str:
        return self._local.path(key)

    def ping(self) -> None:
        try:
            st = os.statvfs(self.root)
        except OSError as e:
            raise RoutingStoreError(f"local_store_dir {self.root} is not there: {e}") from e
        if not os.access(self.root, os.W_OK) or st.f_flag & os.ST_RDONLY:
            raise RoutingStoreError(f"local_store_dir {self.root} is not writable")
        if st.f_bavail * st.f_frsize < 1 << 20:
            raise RoutingStoreError(f"local_store_dir {self.root} has less than 1 MiB free")

    def stored_layers(self, rid: str) -> list[int]:
        layer_dir = self._local.path(f"{rid}.layers")
        names = os.listdir(layer_dir) if os.path.isdir(layer_dir) else []
        return sorted(int(m.group(1)) for m in (re.fullmatch(r"layer_(\d+)\.npy", n) for n in names) if m)

    def delete(self, rollout_id: str, moe_layer_ids: list[int]) -> None:
        super().delete(rollout_id, moe_layer_ids)
        for rid in any_n_rollout_ids(rollout_id):  # per-layer directories left empty
            try:
                os.rmdir(self._local.path(f"{rid}.layers"))
            except OSError:
                pass  # absent, or holds files another writer put there: leave it
