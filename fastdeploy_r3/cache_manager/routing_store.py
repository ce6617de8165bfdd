"""Routing stores: where R3 goes when it is not returned in the response (DESIGN.md §7).

One put per finished request, with one `[T, L, K]` array per choice:

    local      {local_store_dir}/{rid}.npy               fused  [L, T, K]
               {local_store_dir}/{rid}/layer_{layer}.npy  per layer [T, K]
    p2pstore   {namespace}:{rid}                          fused  [L, T, K]  (.npy bytes)
               {namespace}:{rid}:{layer}                  per layer [T, K]

`rid` is the rollout id, with `_{i}` appended for choice i when the request has n > 1; `layer` is
the model's layer index (an entry of `moe_layer_ids`), not the position among the MoE layers.

Contract: `put` returns only when every array is durable in the store (the caller answers the
request afterwards, so a trainer never looks for a key that is not there); it raises
`RoutingStoreError` otherwise. Stores are never wiped at start: other deployments and earlier
rollouts may share them.
"""

from __future__ import annotations

import abc
import io
import os
import re
import secrets
import shutil

import numpy as np

from fastdeploy_r3.config import RoutingReplayConfig

_ROLLOUT_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,256}")

# Most choices one request may have (the API server caps n here). only_last_turn deletes the previous
# turn's entries for every n up to this, because that turn may have had a different n than this one.
MAX_CHOICES = 64


class InvalidRolloutIdError(ValueError):
    """A rollout id (or namespace) that cannot be used as a store key or file name."""


class RoutingStoreError(RuntimeError):
    """A put or delete did not complete; the request must fail rather than leave a missing key."""


def validate_rollout_id(rollout_id: str, what: str = "rollout_id") -> str:
    """Return `rollout_id` if it is `[A-Za-z0-9._:-]{1,256}` and not a path component like `..`."""
    if not isinstance(rollout_id, str) or not _ROLLOUT_ID_RE.fullmatch(rollout_id):
        raise InvalidRolloutIdError(
            f"{what} {rollout_id!r} is invalid; use 1-256 characters from [A-Za-z0-9._:-] (no path separators)"
        )
    if set(rollout_id) == {"."}:
        # only dots would name the store directory or its parent in local mode
        raise InvalidRolloutIdError(f"{what} {rollout_id!r} is invalid; it must not consist of dots only")
    return rollout_id


def choice_rollout_id(rollout_id: str, index: int, n: int) -> str:
    """The id under which choice `index` of an `n`-choice request is stored."""
    return rollout_id if n == 1 else f"{rollout_id}_{index}"


def any_n_rollout_ids(rollout_id: str) -> list[str]:
    """Every id a request with this rollout id may have stored under, whatever its n."""
    return [rollout_id] + [f"{rollout_id}_{i}" for i in range(MAX_CHOICES)]


def previous_turn_rollout_id(rollout_id: str) -> str | None:
    """For `data:gen:turn:segment` with turn > 0, the same segment of the previous turn; else None.

    Other forms are left alone (None): only ids that parse with int() are multi-turn ids.
    """
    parts = rollout_id.rsplit(":", 2)
    if len(parts) != 3 or ":" not in parts[0]:
        return None
    prefix, turn_s, segment_s = parts
    try:
        turn, segment = int(turn_s), int(segment_s)
    except ValueError:
        return None
    if turn <= 0 or segment < 0:
        return None
    return f"{prefix}:{turn - 1}:{segment_s}"


class RoutedExpertsDecodeError(ValueError):
    """A payload or stored value is not an R3 `.npy` array of integer expert ids."""


def npy_bytes(arr: np.ndarray) -> bytes:
    """The `.npy` file of `arr`: self-describing dtype and shape, the wire and store format of R3."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


def load_npy(data: bytes, what: str) -> np.ndarray:
    """Inverse of npy_bytes; refuses pickles and non-integer arrays."""
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise RoutedExpertsDecodeError(f"{what} is not a .npy array: {e}") from e
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu":
        raise RoutedExpertsDecodeError(f"{what} holds {getattr(arr, 'dtype', type(arr))}, not integer expert ids")
    return arr


def _check_choices(routed_experts: list[np.ndarray], moe_layer_ids: list[int]) -> None:
    if not routed_experts:
        raise RoutingStoreError("put() needs at least one choice")
    for i, arr in enumerate(routed_experts):
        if arr.ndim != 3 or arr.shape[1] != len(moe_layer_ids):
            raise RoutingStoreError(
                f"choice {i}: routed_experts has shape {arr.shape}; expected [T, {len(moe_layer_ids)}, K]"
            )


class RoutingStore(abc.ABC):
    """Stores the R3 arrays of finished requests under their rollout ids."""

    def __init__(self, use_fused_put: bool, only_last_turn: bool) -> None:
        self.use_fused_put = use_fused_put
        self.only_last_turn = only_last_turn

    def put(self, rollout_id: str, routed_experts: list[np.ndarray], moe_layer_ids: list[int]) -> list[str]:
        """Store one `[T, L, K]` array per choice; returns the keys (or paths) written.

        Blocking (disk or network): call it off the event loop. With `only_last_turn`, the previous
        turn's entries of a `data:gen:turn:segment` id are deleted once the new ones are in.
        """
        validate_rollout_id(rollout_id)
        _check_choices(routed_experts, moe_layer_ids)
        written = self._put(rollout_id, routed_experts, list(moe_layer_ids))
        if self.only_last_turn:
            prev = previous_turn_rollout_id(rollout_id)
            if prev is not None:
                self._delete(prev, list(moe_layer_ids))
        return written

    def get(self, rollout_id: str, choice: int | None = None, moe_layer_ids: list[int] | None = None) -> np.ndarray:
        """Read one choice back as `[T, L, K]` (the trainer side).

        `choice`: the index of a choice of a request made with n > 1. `moe_layer_ids`: read the per-layer
        entries of these layers, in this order; None reads the fused entry (local: falls back to all
        per-layer files found). Raises KeyError when the rollout is not there.
        """
        validate_rollout_id(rollout_id)
        rid = rollout_id if choice is None else f"{rollout_id}_{choice}"
        return self._get(rid, moe_layer_ids)

    @abc.abstractmethod
    def _get(self, rid: str, moe_layer_ids: list[int] | None) -> np.ndarray: ...

    @abc.abstractmethod
    def _put(self, rollout_id: str, routed_experts: list[np.ndarray], moe_layer_ids: list[int]) -> list[str]: ...

    @abc.abstractmethod
    def _delete(self, rollout_id: str, moe_layer_ids: list[int]) -> None:
        """Remove what any put(rollout_id, ...) wrote, fused or per layer, whatever its number of choices."""

    def close(self) -> None:  # noqa: B027 - an optional hook: a local store holds no connection
        """Release connections; the stored data stays."""


class LocalRoutingStore(RoutingStore):
    """`.npy` files under one directory; every file appears whole (temp file + rename)."""

    def __init__(self, root: str, use_fused_put: bool = True, only_last_turn: bool = False) -> None:
        super().__init__(use_fused_put, only_last_turn)
        self.root = os.path.abspath(root)

    def fused_path(self, rid: str) -> str:
        return os.path.join(self.root, f"{rid}.npy")

    def layer_path(self, rid: str, layer: int) -> str:
        return os.path.join(self.root, rid, f"layer_{layer}.npy")

    def _get(self, rid: str, moe_layer_ids: list[int] | None) -> np.ndarray:
        fused = self.fused_path(rid)
        if moe_layer_ids is None and os.path.isfile(fused):
            with open(fused, "rb") as f:
                return np.ascontiguousarray(load_npy(f.read(), fused).transpose(1, 0, 2))  # [L, T, K] -> [T, L, K]
        layer_dir = os.path.join(self.root, rid)
        if moe_layer_ids is None:
            names = os.listdir(layer_dir) if os.path.isdir(layer_dir) else []
            found = [re.fullmatch(r"layer_(\d+)\.npy", name) for name in names]
            moe_layer_ids = sorted(int(m.group(1)) for m in found if m)
            if not moe_layer_ids:
                raise KeyError(f"no R3 for rollout {rid!r} under {self.root} (neither {fused} nor {layer_dir}/)")
        layers = []
        for layer in moe_layer_ids:
            path = self.layer_path(rid, layer)
            if not os.path.isfile(path):
                raise KeyError(f"no R3 for rollout {rid!r} layer {layer}: {path} is missing")
            with open(path, "rb") as f:
                layers.append(load_npy(f.read(), path))  # [T, K]
        return np.stack(layers, axis=1)  # [T, L, K]

    def _write_atomic(self, path: str, arr: np.ndarray) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            with open(tmp, "wb") as f:
                f.write(npy_bytes(arr))
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def _put(self, rollout_id: str, routed_experts: list[np.ndarray], moe_layer_ids: list[int]) -> list[str]:
        n = len(routed_experts)
        written: list[str] = []
        try:
            for i, arr in enumerate(routed_experts):
                rid = choice_rollout_id(rollout_id, i, n)
                if self.use_fused_put:
                    path = self.fused_path(rid)
                    self._write_atomic(path, arr.transpose(1, 0, 2))  # [T, L, K] -> [L, T, K]
                    written.append(path)
                else:
                    for j, layer in enumerate(moe_layer_ids):
                        path = self.layer_path(rid, layer)
                        self._write_atomic(path, arr[:, j, :])  # [T, K]
                        written.append(path)
        except OSError as e:
            raise RoutingStoreError(f"writing R3 of rollout {rollout_id!r} under {self.root} failed: {e}") from e
        return written

    def _delete(self, rollout_id: str, moe_layer_ids: list[int]) -> None:
        try:
            for rid in any_n_rollout_ids(rollout_id):
                if os.path.exists(self.fused_path(rid)):
                    os.unlink(self.fused_path(rid))
                layer_dir = os.path.join(self.root, rid)
                if os.path.isdir(layer_dir):
                    shutil.rmtree(layer_dir)
        except OSError as e:
            raise RoutingStoreError(f"deleting R3 of previous turn {rollout_id!r} failed: {e}") from e


class RedisRoutingStore(RoutingStore):
    """Redis keys `{namespace}:{rid}[:{layer}]` holding `.npy` bytes, each expiring after `ttl_s`."""

    def __init__(
        self,
        url: str,
        namespace: str,
        ttl_s: int = 3600,
        use_fused_put: bool = True,
        only_last_turn: bool = False,
    ) -> None:
        import redis

        super().__init__(use_fused_put, only_last_turn)
        self.namespace = validate_rollout_id(namespace, "namespace")
        self.ttl_s = int(ttl_s)
        self.url = url
        self._redis = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=10)

    def key(self, rid: str, layer: int | None = None) -> str:
        return f"{self.namespace}:{rid}" if layer is None else f"{self.namespace}:{rid}:{layer}"

    def ping(self) -> None:
        """Fail at start-up, not at the first rollout, when the store cannot be reached."""
        try:
            self._redis.ping()
        except Exception as e:
            raise RoutingStoreError(f"cannot reach the R3 p2pstore at {redact_url(self.url)}: {e}") from e

    def _get(self, rid: str, moe_layer_ids: list[int] | None) -> np.ndarray:
        if moe_layer_ids is None:
            key = self.key(rid)
            data = self._redis.get(key)
            if data is None:
                raise KeyError(f"no R3 under key {key!r} (expired, or the server stores per layer?)")
            return np.ascontiguousarray(load_npy(data, key).transpose(1, 0, 2))  # [L, T, K] -> [T, L, K]
        keys = [self.key(rid, layer) for layer in moe_layer_ids]
        values = self._redis.mget(keys)
        missing = [k for k, v in zip(keys, values, strict=True) if v is None]
        if missing:
            raise KeyError(f"no R3 under keys {missing}")
        return np.stack([load_npy(v, k) for k, v in zip(keys, values, strict=True)], axis=1)  # [T, L, K]

    def _put(self, rollout_id: str, routed_experts: list[np.ndarray], moe_layer_ids: list[int]) -> list[str]:
        n = len(routed_experts)
        written: list[str] = []
        # one round trip, in a MULTI so that a reader never sees some layers of a rollout but not others
        pipe = self._redis.pipeline(transaction=True)
        for i, arr in enumerate(routed_experts):
            rid = choice_rollout_id(rollout_id, i, n)
            if self.use_fused_put:
                key = self.key(rid)
                pipe.set(key, npy_bytes(arr.transpose(1, 0, 2)), ex=self.ttl_s)  # [L, T, K]
                written.append(key)
            else:
                for j, layer in enumerate(moe_layer_ids):
                    key = self.key(rid, layer)
                    pipe.set(key, npy_bytes(arr[:, j, :]), ex=self.ttl_s)  # [T, K]
                    written.append(key)
        try:
            results = pipe.execute()
        except Exception as e:
            where = redact_url(self.url)
            raise RoutingStoreError(f"storing R3 of rollout {rollout_id!r} in {where} failed: {e}") from e
        if not all(results):
            raise RoutingStoreError(f"storing R3 of rollout {rollout_id!r}: the store refused {written}")
        return written

    def _delete(self, rollout_id: str, moe_layer_ids: list[int]) -> None:
        keys = []
        for rid in any_n_rollout_ids(rollout_id):
            keys.append(self.key(rid))
            keys.extend(self.key(rid, layer) for layer in moe_layer_ids)
        try:
            self._redis.delete(*keys)
        except Exception as e:
            raise RoutingStoreError(f"deleting R3 of previous turn {rollout_id!r} failed: {e}") from e

    def close(self) -> None:
        self._redis.close()


def redact_url(url: str) -> str:
    """A URL without its password, for messages and metadata."""
    return re.sub(r"//([^:@/]*):[^@/]*@", r"//\1:***@", url)


def make_routing_store(cfg: RoutingReplayConfig, namespace: str) -> RoutingStore | None:
    """The store of a deployment, or None when R3 is off or returned in responses."""
    if not cfg.enable_routing_replay or cfg.routing_store_type == "response":
        return None
    if cfg.routing_store_type == "local":
        assert cfg.local_store_dir is not None  # RoutingReplayConfig.validate() checked
        try:
            os.makedirs(cfg.local_store_dir, exist_ok=True)  # fail at start-up, not at the first rollout
        except OSError as e:
            raise RoutingStoreError(f"local_store_dir {cfg.local_store_dir!r} cannot be created: {e}") from e
        return LocalRoutingStore(cfg.local_store_dir, cfg.use_fused_put, cfg.only_last_turn)
    if cfg.routing_store_type == "p2pstore":
        assert cfg.p2pstore_url is not None
        if cfg.p2pstore_url.startswith("mooncake://"):
            from fastdeploy_r3.cache_manager.mooncake_backends import MooncakeRoutingStore

            return MooncakeRoutingStore(cfg.p2pstore_url, namespace, cfg.use_fused_put, cfg.only_last_turn)
        return RedisRoutingStore(cfg.p2pstore_url, namespace, cfg.ttl_s, cfg.use_fused_put, cfg.only_last_turn)
    raise RoutingStoreError(f"unknown routing_store_type {cfg.routing_store_type!r}")
