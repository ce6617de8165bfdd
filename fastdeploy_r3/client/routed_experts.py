"""Trainer-side R3: read stores, lay rows out for a Megatron-style router replay (payloads: r3/codec.py).

Shapes: T = tokens of a sequence (prompt + completion), L = MoE layers, K = experts per token.
The engine returns `[T-1, L, K]` (the last token was sampled, never fed through the model).
The codec, the layouts and the stores are fastdeploy_r3.r3's, the same code the server writes with, so
what the server writes and what the trainer reads cannot drift apart.
"""

from __future__ import annotations

import numpy as np

from fastdeploy_r3.r3.layouts import check_moe_rows
from fastdeploy_r3.r3.stores import LocalRoutingStore, RedisRoutingStore


def read_local_rollout(
    store_dir: str,
    rollout_id: str,
    choice: int | None = None,
    moe_layer_ids: list[int] | None = None,
) -> np.ndarray:
    """Read one rollout written by the server's `local` store -> `[T-1, L, K]`.

    `choice` is the choice index of a request made with n > 1 (stored as `{rollout_id}_{choice}`).
    Reads the fused file `{rid}.npy` if present, else the per-layer files `{rid}/layer_{layer}.npy`
    (`moe_layer_ids` picks and orders the layers; by default all found, in layer order).
    """
    return LocalRoutingStore(store_dir).get(rollout_id, choice, moe_layer_ids)


def read_redis_rollout(
    url: str,
    namespace: str,
    rollout_id: str,
    choice: int | None = None,
    moe_layer_ids: list[int] | None = None,
) -> np.ndarray:
    """Read one rollout from the server's `p2pstore` (Redis) -> `[T-1, L, K]`.

    Reads the fused key `{namespace}:{rid}` when `moe_layer_ids` is None, else the per-layer keys
    `{namespace}:{rid}:{layer}` (a server started with `use_fused_put: false`).
    """
    store = RedisRoutingStore(url, namespace)
    try:
        return store.get(rollout_id, choice, moe_layer_ids)
    finally:
        store.close()


def to_megatron_router_replay(routed_experts: np.ndarray, moe_layer_ids: list[int]) -> list:
    """`[T-1, L, K]` -> one int64 tensor `[T, K]` per MoE layer, in `moe_layer_ids` order.

    A Megatron-style router replay wants a row for every token of the sequence; the last token has
    no recorded routing (it was never forwarded), so its row is padded with the K distinct ids
    0..K-1 — any valid top-k works, since that position's output is not trained on.
    Raises R3PayloadError (a ValueError) on the "no route" sentinel (dtype max): replaying a hole
    would silently train on garbage.
    """
    import torch

    check_moe_rows(routed_experts, moe_layer_ids)  # R3PayloadError (a ValueError): shape, or a no-route hole
    k = routed_experts.shape[2]
    pad = np.arange(k, dtype=np.int64)[None, :]  # [1, K]
    out = []
    for j in range(len(moe_layer_ids)):
        rows = routed_experts[:, j, :].astype(np.int64)  # [T-1, K]
        out.append(torch.from_numpy(np.concatenate([rows, pad], axis=0)))  # [T, K]
    return out
