"""Trainer-side R3: decode payloads, read stores, lay rows out for a Megatron-style router replay.

Shapes: T = tokens of a sequence (prompt + completion), L = MoE layers, K = experts per token.
The engine returns `[T-1, L, K]` (the last token was sampled, never fed through the model).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re

import numpy as np

_ROLLOUT_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,256}")


class RoutedExpertsDecodeError(ValueError):
    """A payload or stored value is not an R3 `.npy` array of the expected form."""


def encode_routed_experts(arr: np.ndarray) -> str:
    """`[rows, L, K]` -> base64 of an `.npy` file (the `routed_experts` field of a choice)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _load_npy(data: bytes, what: str) -> np.ndarray:
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise RoutedExpertsDecodeError(f"{what} is not a .npy array: {e}") from e
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu":
        raise RoutedExpertsDecodeError(f"{what} holds {getattr(arr, 'dtype', type(arr))}, not integer expert ids")
    return arr


def decode_routed_experts(b64: str) -> np.ndarray:
    """base64 `.npy` payload -> `[rows, L, K]` integer array (uint8/uint16/int32, as sent)."""
    try:
        data = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RoutedExpertsDecodeError(f"routed_experts is not base64: {e}") from e
    arr = _load_npy(data, "routed_experts")
    if arr.ndim != 3:
        raise RoutedExpertsDecodeError(f"routed_experts has shape {arr.shape}; expected [rows, L, K]")
    return arr


def _check_id(rollout_id: str) -> None:
    if not _ROLLOUT_ID_RE.fullmatch(rollout_id) or set(rollout_id) == {"."}:
        raise ValueError(f"rollout_id {rollout_id!r} is invalid; use 1-256 characters from [A-Za-z0-9._:-]")


def _stored_id(rollout_id: str, choice: int | None) -> str:
    _check_id(rollout_id)
    return rollout_id if choice is None else f"{rollout_id}_{choice}"


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
    rid = _stored_id(rollout_id, choice)
    fused = os.path.join(store_dir, f"{rid}.npy")
    if os.path.isfile(fused):
        with open(fused, "rb") as f:
            arr = _load_npy(f.read(), fused)  # [L, T, K]
        return np.ascontiguousarray(arr.transpose(1, 0, 2))
    layer_dir = os.path.join(store_dir, rid)
    if moe_layer_ids is None:
        names = os.listdir(layer_dir) if os.path.isdir(layer_dir) else []
        found = [re.fullmatch(r"layer_(\d+)\.npy", name) for name in names]
        moe_layer_ids = sorted(int(m.group(1)) for m in found if m)
    if not moe_layer_ids:
        raise FileNotFoundError(f"no R3 for rollout {rid!r} under {store_dir} (neither {fused} nor {layer_dir}/)")
    layers = []
    for layer in moe_layer_ids:
        path = os.path.join(layer_dir, f"layer_{layer}.npy")
        with open(path, "rb") as f:
            layers.append(_load_npy(f.read(), path))  # [T, K]
    return np.stack(layers, axis=1)  # [T, L, K]


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
    import redis

    rid = _stored_id(rollout_id, choice)
    client = redis.Redis.from_url(url)
    try:
        if moe_layer_ids is None:
            key = f"{namespace}:{rid}"
            data = client.get(key)
            if data is None:
                raise KeyError(f"no R3 under key {key!r} (expired, or the server stores per layer?)")
            return np.ascontiguousarray(_load_npy(data, key).transpose(1, 0, 2))
        keys = [f"{namespace}:{rid}:{layer}" for layer in moe_layer_ids]
        values = client.mget(keys)
        missing = [k for k, v in zip(keys, values) if v is None]
        if missing:
            raise KeyError(f"no R3 under keys {missing}")
        return np.stack([_load_npy(v, k) for k, v in zip(keys, values)], axis=1)  # [T, L, K]
    finally:
        client.close()


def to_megatron_router_replay(routed_experts: np.ndarray, moe_layer_ids: list[int]) -> list:
    """`[T-1, L, K]` -> one int64 tensor `[T, K]` per MoE layer, in `moe_layer_ids` order.

    A Megatron-style router replay wants a row for every token of the sequence; the last token has
    no recorded routing (it was never forwarded), so its row is padded with the K distinct ids
    0..K-1 — any valid top-k works, since that position's output is not trained on.
    Raises on the "no route" sentinel (dtype max): replaying a hole would silently train on garbage.
    """
    import torch

    if routed_experts.ndim != 3 or routed_experts.shape[1] != len(moe_layer_ids):
        raise ValueError(f"routed_experts has shape {routed_experts.shape}; expected [T-1, {len(moe_layer_ids)}, K]")
    if routed_experts.dtype.kind == "u" and routed_experts.size:
        sentinel = np.iinfo(routed_experts.dtype).max
        holes = np.argwhere(routed_experts == sentinel)
        if len(holes):
            row, layer, _ = holes[0]
            raise ValueError(f"routed_experts row {row} layer {moe_layer_ids[layer]} holds the no-route sentinel")
    k = routed_experts.shape[2]
    pad = np.arange(k, dtype=np.int64)[None, :]  # [1, K]
    out = []
    for j in range(len(moe_layer_ids)):
        rows = routed_experts[:, j, :].astype(np.int64)  # [T-1, K]
        out.append(torch.from_numpy(np.concatenate([rows, pad], axis=0)))  # [T, K]
    return out
