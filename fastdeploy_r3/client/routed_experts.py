"""Trainer-side R3: read stores, lay rows out for a Megatron-style router replay (payloads: r3/codec.py).

Shapes: T = tokens of a sequence (prompt + completion), L = MoE layers, H = all hidden layers,
K = experts per token. The engine returns `[T-1, L, K]` (the last token was sampled, never fed through
the model), or `[T-1, H, K]` in the `all_layers` layout (dense layers hold the no-route sentinel);
the store readers return what was stored; `to_moe_layout` turns either into `[T-1, L, K]`.
The codec, the layouts and the stores are fastdeploy_r3.r3's, the same code the server writes with, so
what the server writes and what the trainer reads cannot drift apart.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fastdeploy_r3.r3.layouts import R3PayloadError, check_moe_rows
from fastdeploy_r3.r3.stores import LocalRoutingStore, RedisRoutingStore


def to_moe_layout(
    routed_experts: np.ndarray, moe_layer_ids: list[int], num_hidden_layers: int | None = None
) -> np.ndarray:
    """`[T-1, L, K]` as it is, or all_layers `[T-1, H, K]` (H = num_hidden_layers, indexed by model layer
    id) -> `[T-1, L, K]`. The layout is told by the layer count, so H must be given to accept all_layers."""
    if routed_experts.ndim == 3 and routed_experts.shape[1] == len(moe_layer_ids):
        return routed_experts
    if routed_experts.ndim == 3 and num_hidden_layers is not None and routed_experts.shape[1] == num_hidden_layers:
        return np.ascontiguousarray(routed_experts[:, moe_layer_ids, :])
    want = f"[rows, {len(moe_layer_ids)}, K]"
    if num_hidden_layers is not None:
        want += f" or [rows, {num_hidden_layers}, K]"
    raise R3PayloadError(f"routed_experts has shape {list(routed_experts.shape)}; expected {want}")


def read_local_rollout(
    store_dir: str,
    rollout_id: str,
    choice: int | None = None,
    moe_layer_ids: list[int] | None = None,
) -> np.ndarray:
    """Read one rollout written by the server's `local` store -> `[T-1, L, K]`.

    `choice` is the choice index of a request made with n > 1 (stored as `{rollout_id}#{choice}`).
    Reads the fused file `{rid}.npy` if present, else the per-layer files `{rid}.layers/layer_{layer}.npy`
    (`moe_layer_ids` picks and orders the layers; by default all found, in layer order).
    """
    return LocalRoutingStore(store_dir).get(rollout_id, choice, moe_layer_ids)


def read_local_rollout_meta(store_dir: str, rollout_id: str) -> dict[str, Any]:
    """What the `local` store keeps beside a rollout: weight_version, weight_versions (per choice, spans of
    output tokens), spans_weight_versions, routing_layout and layer_ids."""
    return LocalRoutingStore(store_dir).get_meta(rollout_id)


def read_redis_rollout_meta(url: str, namespace: str, rollout_id: str) -> dict[str, Any]:
    """read_local_rollout_meta for the `p2pstore` (Redis)."""
    store = RedisRoutingStore(url, namespace)
    try:
        return store.get_meta(rollout_id)
    finally:
        store.close()


def read_redis_rollout(
    url: str,
    namespace: str,
    rollout_id: str,
    choice: int | None = None,
    moe_layer_ids: list[int] | None = None,
) -> np.ndarray:
    """Read one rollout from the server's `p2pstore` (Redis) -> `[T-1, L, K]`.

    Reads the fused key `{namespace}/{rid}` when `moe_layer_ids` is None, else the per-layer keys
    `{namespace}/{rid}/layer_{layer}` (a server started with `use_fused_put: false`).
    """
    store = RedisRoutingStore(url, namespace)
    try:
        return store.get(rollout_id, choice, moe_layer_ids)
    finally:
        store.close()


def to_megatron_router_replay(
    routed_experts: np.ndarray, moe_layer_ids: list[int], num_hidden_layers: int | None = None
) -> list:
    """`[T-1, L, K]` (or all_layers `[T-1, H, K]`, given H) -> one int64 tensor `[T, K]` per MoE layer,
    in `moe_layer_ids` order.

    A Megatron-style router replay wants a row for every token of the sequence; the last token has
    no recorded routing (it was never forwarded), so its row is padded with the K distinct ids
    0..K-1 — any valid top-k works, since that position's output is not trained on.
    Raises R3PayloadError (a ValueError) on the "no route" sentinel (dtype max): replaying a hole
    would silently train on garbage.
    """
    import torch

    routed_experts = to_moe_layout(routed_experts, moe_layer_ids, num_hidden_layers)
    check_moe_rows(routed_experts, moe_layer_ids)  # R3PayloadError (a ValueError): shape, or a no-route hole
    k = routed_experts.shape[2]
    pad = np.arange(k, dtype=np.int64)[None, :]  # [1, K]
    out = []
    for j in range(len(moe_layer_ids)):
        rows = routed_experts[:, j, :].astype(np.int64)  # [T-1, K]
        out.append(torch.from_numpy(np.concatenate([rows, pad], axis=0)))  # [T, K]
    return out
