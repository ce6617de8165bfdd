"""Routing stores: where R3 goes when it is not returned in the response, one per deployment.

    base.py      RoutingStore (key scheme, put / get / delete / meta on a BlobStore), RoutingStoreError
    local.py     LocalRoutingStore: `.npy` files under local_store_dir
    redis.py     RedisRoutingStore: `.npy` bytes in Redis under `{namespace}/`
    mooncake.py  MooncakeRoutingStore: checksummed `.npy` bytes in Mooncake (needs the mooncake extra)
    make_routing_store(cfg, namespace)  the store a RoutingReplayConfig asks for, or None

The backends import base.py and the storage room (blobstore/); nothing here imports a backend but
make_routing_store, which loads Mooncake's only when asked for it.
"""

from __future__ import annotations

import os

from fastdeploy_r3.blobstore.base import DIR_MODE
from fastdeploy_r3.r3.config import RoutingReplayConfig
from fastdeploy_r3.r3.stores.base import RoutingStore, RoutingStoreError
from fastdeploy_r3.r3.stores.local import LocalRoutingStore
from fastdeploy_r3.r3.stores.redis import RedisRoutingStore

__all__ = [
    "LocalRoutingStore",
    "RedisRoutingStore",
    "RoutingStore",
    "RoutingStoreError",
    "make_routing_store",
]


def make_routing_store(cfg: RoutingReplayConfig, namespace: str) -> RoutingStore | None:
    """The store of a deployment, or None when R3 is off or returned in responses."""
    if not cfg.enable_routing_replay or cfg.routing_store_type == "response":
        return None
    if cfg.routing_store_type == "local":
        assert cfg.local_store_dir is not None  # RoutingReplayConfig.validate() checked
        try:
            # fail at start-up, not at the first rollout; a new directory is the server user's only
            os.makedirs(cfg.local_store_dir, mode=DIR_MODE, exist_ok=True)
        except OSError as e:
            raise RoutingStoreError(f"local_store_dir {cfg.local_store_dir!r} cannot be created: {e}") from e
        capacity = None if cfg.local_store_capacity_gib is None else int(cfg.local_store_capacity_gib * 2**30)
        return LocalRoutingStore(cfg.local_store_dir, cfg.use_fused_put, cfg.only_last_turn, cfg.ttl_s, capacity)
    if cfg.routing_store_type == "p2pstore":
        assert cfg.p2pstore_url is not None
        if cfg.p2pstore_url.startswith("mooncake://"):
            from fastdeploy_r3.r3.stores.mooncake import MooncakeRoutingStore  # needs the mooncake extra

            return MooncakeRoutingStore(cfg.p2pstore_url, namespace, cfg.use_fused_put, cfg.only_last_turn)
        return RedisRoutingStore(cfg.p2pstore_url, namespace, cfg.ttl_s, cfg.use_fused_put, cfg.only_last_turn,
                                 timeout_s=float(cfg.store_timeout_s))
    raise RoutingStoreError(f"unknown routing_store_type {cfg.routing_store_type!r}")
