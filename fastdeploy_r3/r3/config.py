"""The R3 settings of a deployment (`--routing-replay-config`, JSON) and the shape derived from the model.

It lives with the rest of r3/ so that a trainer-side reader can load it without the engine's config;
EngineConfig (config/engine.py) holds the one `postprocess(model_config)` returns once the model is read.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from fastdeploy_r3.errors import ConfigError
from fastdeploy_r3.json_args import json_object_arg


class ModelShape(Protocol):
    """What R3 reads of a ModelConfig (config/engine.py), named here so r3/ needs no config class."""

    num_hidden_layers: int
    num_experts: int
    moe_top_k: int
    moe_layer_ids: list[int]


def routing_dtype_for(num_experts: int) -> np.dtype:
    """uint8 when ids fit below the sentinel 255, uint16 below 65535, else int32."""
    if num_experts <= 255:
        return np.dtype(np.uint8)
    if num_experts <= 65535:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


_ROUTING_STORE_TYPES = ("response", "local", "p2pstore")
# moe: [rows, L, K] plus moe_layer_ids (FastDeploy's readers); all_layers: [rows, num_hidden_layers, K] with
# dense layers holding the no-route sentinel (vLLM, SGLang and slime index layers by absolute id)
ROUTING_LAYOUTS = ("moe", "all_layers")


@dataclass(frozen=True)
class RoutingReplayConfig:
    enable_routing_replay: bool = False
    routing_store_type: str = "response"
    local_store_dir: str | None = None
    p2pstore_url: str | None = None
    only_last_turn: bool = False
    use_fused_put: bool = True
    debug_mode: bool = False
    ttl_s: int = 3600
    routing_layout: str = "moe"
    store_timeout_s: float | int = 10.0  # deadline of one R3 store put: past it the request fails, the store degrades
    local_store_capacity_gib: float | int | None = None  # local store: least recently used rollouts go past it
    # derived by postprocess(model_config), which returns a new config
    moe_layer_ids: list[int] | None = field(init=False, default=None, repr=False)
    num_hidden_layers: int = field(init=False, default=0)  # layers of the all_layers layout (an MTP layer is not one)
    num_moe_layers: int = field(init=False, default=0)
    moe_top_k: int = field(init=False, default=0)
    num_experts: int = field(init=False, default=0)
    routing_dtype: np.dtype | None = field(init=False, default=None)

    @classmethod
    def json_keys(cls) -> dict[str, tuple[type, ...]]:
        """The JSON keys (the constructor fields) and the types each accepts, from the annotations."""
        hints = typing.get_type_hints(cls)
        keys = {}
        for f in dataclasses.fields(cls):
            if f.init:
                hint = hints[f.name]
                keys[f.name] = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        return keys

    @classmethod
    def from_json(cls, value: str | dict[str, Any] | RoutingReplayConfig | None) -> RoutingReplayConfig:
        """Parse a JSON string, a path to a JSON file, a dict, or pass a config through."""
        if value is None:
            return cls()
        if isinstance(value, RoutingReplayConfig):
            return value
        if isinstance(value, str):
            value = json_object_arg(value, "--routing-replay-config", '{"enable_routing_replay": true}')
        if not isinstance(value, dict):
            raise ConfigError("--routing-replay-config must be a JSON object")
        types_of = cls.json_keys()
        known = set(types_of)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(
                f"unknown routing replay key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(known))}"
            )
        for key, v in value.items():
            want = types_of[key]
            ok = isinstance(v, want) and not (bool not in want and isinstance(v, bool))  # bool is an int
            if not ok:
                names = " or ".join(t.__name__ for t in want)
                raise ConfigError(f"routing replay key {key!r} must be {names}, got {type(v).__name__} {v!r}")
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.routing_store_type not in _ROUTING_STORE_TYPES:
            raise ConfigError(
                f"routing_store_type={self.routing_store_type!r}; use one of {', '.join(_ROUTING_STORE_TYPES)}"
            )
        if self.enable_routing_replay and self.routing_store_type == "local" and not self.local_store_dir:
            raise ConfigError("routing_store_type 'local' needs local_store_dir (a directory to write .npy files)")
        if self.enable_routing_replay and self.routing_store_type == "p2pstore" and not self.p2pstore_url:
            raise ConfigError(
                "routing_store_type 'p2pstore' needs p2pstore_url, e.g. redis://127.0.0.1:6379/0 or "
                "mooncake://127.0.0.1:50051?metadata=P2PHANDSHAKE&protocol=tcp"
            )
        if self.ttl_s <= 0:
            raise ConfigError(f"ttl_s={self.ttl_s}; use a positive number of seconds")
        if self.routing_layout not in ROUTING_LAYOUTS:
            raise ConfigError(f"routing_layout={self.routing_layout!r}; use one of {', '.join(ROUTING_LAYOUTS)}")
        if not self.store_timeout_s > 0:
            raise ConfigError(f"store_timeout_s={self.store_timeout_s}; use a positive number of seconds")
        if self.local_store_capacity_gib is not None and not self.local_store_capacity_gib > 0:
            raise ConfigError(f"local_store_capacity_gib={self.local_store_capacity_gib}; use a positive size or "
                              "leave it out (rollouts then go only after ttl_s)")

    def postprocess(self, model_config: ModelShape) -> RoutingReplayConfig:
        """This config with the R3 shape derived from the model's (a new frozen config); once only."""
        if self.moe_layer_ids is not None:
            raise ConfigError("RoutingReplayConfig.postprocess() was called twice")
        out = dataclasses.replace(self)
        derived = {
            "moe_layer_ids": list(model_config.moe_layer_ids),
            "num_moe_layers": len(model_config.moe_layer_ids),
            "num_hidden_layers": model_config.num_hidden_layers,
            "moe_top_k": model_config.moe_top_k,
            "num_experts": model_config.num_experts,
            "routing_dtype": routing_dtype_for(model_config.num_experts),
        }
        for name, value in derived.items():
            object.__setattr__(out, name, value)  # the copy is not yet shared: it is finalised, then frozen
        return out

    @property
    def sentinel(self) -> int:
        assert self.routing_dtype is not None, "postprocess() first"
        return int(np.iinfo(self.routing_dtype).max)

    def to_json(self) -> str:
        return json.dumps({name: getattr(self, name) for name in self.json_keys()})
