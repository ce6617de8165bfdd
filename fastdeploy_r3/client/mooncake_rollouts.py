"""Trainer-side reads of R3 from a Mooncake p2pstore: this server's values and FastDeploy's bare arrays.

Shapes: T = tokens (rows), L = MoE layers, K = experts per token. Reads return `[T, L, K]`, as the
local and Redis readers do.

FastDeploy's own p2pstore puts, under `{rollout_id}` (fused) or `{rollout_id}_{layer}` (per layer),
the bare bytes of an array padded with -1 rows up to max_model_len: fused `[L, max_model_len, K]`,
per layer `[max_model_len, K]`, no header. Reading them needs L, K and the dtype from the caller.
"""

from __future__ import annotations

import numpy as np

from fastdeploy_r3.blobstore.mooncake import MooncakeBlobStore
from fastdeploy_r3.r3.codec import RoutedExpertsDecodeError
from fastdeploy_r3.r3.rollout_id import validate_rollout_id
from fastdeploy_r3.r3.stores.mooncake import MooncakeRoutingStore


def read_mooncake_rollout(
    url: str,
    namespace: str,
    rollout_id: str,
    choice: int | None = None,
    moe_layer_ids: list[int] | None = None,
    release: bool = False,
) -> np.ndarray:
    """Read one rollout the server put in Mooncake (`p2pstore_url` = `url`) -> `[T-1, L, K]`.

    Keys follow the URL's `key_style`; `moe_layer_ids` reads the per-layer keys of a server started
    with `use_fused_put: false`. `release=True` deletes the rollout once read (it is hard-pinned until
    then). Raises KeyError when it is not there, RoutedExpertsDecodeError when an object is corrupt.
    This reader contributes no memory to the store (segment 0).
    """
    store = MooncakeRoutingStore(url, namespace, segment_bytes=0)
    try:
        arr = store.get(rollout_id, choice, moe_layer_ids)
        if release:
            store.release(rollout_id, choice, moe_layer_ids)
        return arr
    finally:
        store.close()


def decode_fastdeploy_routing(data: bytes, num_layers: int | None, top_k: int, dtype: str = "int32") -> np.ndarray:
    """One bare FastDeploy value -> `[T, L, K]` (fused: `num_layers` given) or `[T, K]` (one layer, None).

    Trailing rows that are -1 in every layer are FastDeploy's padding and are dropped; a -1 inside the
    kept rows, or a size that does not divide into rows, is an error rather than data.
    """
    item = np.dtype(dtype)
    row_items = (num_layers or 1) * top_k
    if item.kind != "i" or len(data) == 0 or len(data) % (item.itemsize * row_items):
        raise RoutedExpertsDecodeError(
            f"{len(data)} bytes are not whole rows of {num_layers or 1} layer(s) x {top_k} {item} ids; "
            "check num_layers, top_k and dtype against the server that wrote them"
        )
    arr = np.frombuffer(data, dtype=item)
    if num_layers is None:
        rows = arr.reshape(-1, top_k)  # [max_model_len, K]
        per_token = rows[:, None, :]  # [max_model_len, 1, K]
    else:
        per_token = arr.reshape(num_layers, -1, top_k).transpose(1, 0, 2)  # [L, max_len, K] -> [max_len, L, K]
    padded = np.all(per_token == -1, axis=(1, 2))  # [max_model_len]
    kept = np.flatnonzero(~padded)
    num_rows = int(kept[-1]) + 1 if len(kept) else 0
    out = np.ascontiguousarray(per_token[:num_rows])
    if (out == -1).any():
        raise RoutedExpertsDecodeError("a -1 (no expert) inside the routed rows: the stored value is incomplete")
    return out if num_layers is not None else out[:, 0, :]


def read_fastdeploy_rollout(
    url: str,
    rollout_id: str,
    moe_layer_ids: list[int],
    top_k: int,
    dtype: str = "int32",
    fused: bool = True,
) -> np.ndarray:
    """Read R3 that FastDeploy itself put in Mooncake (bare arrays under its keys) -> `[T, L, K]`."""
    validate_rollout_id(rollout_id)
    keys = [rollout_id] if fused else [f"{rollout_id}_{layer}" for layer in moe_layer_ids]
    store = MooncakeBlobStore(url, segment_bytes=0)  # bare bytes: FastDeploy's values carry no checksum
    try:
        values = store.get_many(keys)
    finally:
        store.close()
    missing = [k for k, v in zip(keys, values, strict=True) if v is None]
    if missing:
        raise KeyError(f"no FastDeploy R3 under keys {missing}")
    if fused:
        return decode_fastdeploy_routing(values[0], len(moe_layer_ids), top_k, dtype)
    layers = [decode_fastdeploy_routing(v, None, top_k, dtype) for v in values]  # L x [T, K]
    if len({len(x) for x in layers}) != 1:
        raise RoutedExpertsDecodeError(f"per-layer R3 of {rollout_id!r} has {[len(x) for x in layers]} rows")
    return np.stack(layers, axis=1)  # [T, L, K]
