"""RoutingReplayConfig (DESIGN.md §6): parsing, validation, and the R3 shape derived from the model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fastdeploy_r3.config import ConfigError, ModelConfig
from fastdeploy_r3.r3.config import RoutingReplayConfig, routing_dtype_for

GLM45_LIKE = {
    "architectures": ["Glm4MoeForCausalLM"],
    "num_hidden_layers": 46,
    "first_k_dense_replace": 1,
    "n_routed_experts": 160,
    "num_experts_per_tok": 8,
    "hidden_size": 64,
    "vocab_size": 128,
    "num_attention_heads": 4,
}


def _model_config(tmp_path: Path, **overrides: Any) -> ModelConfig:
    """A finalized ModelConfig read from <tmp_path>/config.json."""
    (tmp_path / "config.json").write_text(json.dumps({**GLM45_LIKE, **overrides}))
    return ModelConfig(model=str(tmp_path)).finalize()


def test_parses_json_string_file_path_and_dict(tmp_path: Path) -> None:
    """The three spellings of --routing-replay-config give the same config."""
    fields = {"enable_routing_replay": True, "routing_store_type": "local", "local_store_dir": "/tmp/r3",
              "debug_mode": True, "ttl_s": 60}
    path = tmp_path / "r3.json"
    path.write_text(json.dumps(fields))
    for value in (json.dumps(fields), str(path), fields):
        cfg = RoutingReplayConfig.from_json(value)
        assert (cfg.enable_routing_replay, cfg.routing_store_type, cfg.local_store_dir, cfg.debug_mode, cfg.ttl_s) == (
            True, "local", "/tmp/r3", True, 60)
    assert RoutingReplayConfig.from_json(None) == RoutingReplayConfig()
    assert RoutingReplayConfig.from_json(RoutingReplayConfig.from_json(fields).to_json()).ttl_s == 60


def test_unknown_key_lists_known_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown routing replay key\(s\) enable_r3, zzz; known keys: .*debug_mode"):
        RoutingReplayConfig.from_json({"enable_r3": True, "zzz": 1})


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"ttl_s": True}, r"'ttl_s' must be int, got bool"),  # bool is an int subclass; refused all the same
        ({"ttl_s": "60"}, r"'ttl_s' must be int, got str"),
        ({"enable_routing_replay": 1}, r"'enable_routing_replay' must be bool, got int"),
        ({"local_store_dir": 3}, r"'local_store_dir' must be str or NoneType"),
        ({"routing_store_type": "s3"}, r"routing_store_type='s3'; use one of response, local, p2pstore"),
        ({"ttl_s": 0}, r"ttl_s=0; use a positive"),
        ({"enable_routing_replay": True, "routing_store_type": "p2pstore"}, r"needs p2pstore_url"),
    ],
)
def test_wrong_values_are_rejected(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RoutingReplayConfig.from_json(fields)


def test_malformed_json_and_non_object_are_rejected() -> None:
    with pytest.raises(ConfigError, match="not valid JSON"):
        RoutingReplayConfig.from_json("{enable_routing_replay: true")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        RoutingReplayConfig.from_json("[1, 2]")


def test_glm45_like_model_has_45_moe_layers_after_the_dense_one(tmp_path: Path) -> None:
    """46 layers, first_k_dense_replace=1, 160 experts, top-8: L = 45 (layers 1..45), uint8, sentinel 255."""
    cfg = RoutingReplayConfig.from_json({"enable_routing_replay": True})
    cfg.postprocess(_model_config(tmp_path))
    assert cfg.moe_layer_ids == list(range(1, 46))
    assert (cfg.num_moe_layers, cfg.moe_top_k, cfg.num_experts) == (45, 8, 160)
    assert cfg.routing_dtype == np.uint8 and cfg.sentinel == 255


@pytest.mark.parametrize(
    ("num_experts", "dtype"),
    [(1, np.uint8), (255, np.uint8), (256, np.uint16), (65535, np.uint16), (65536, np.int32)],
)
def test_routing_dtype_keeps_the_sentinel_above_every_id(tmp_path: Path, num_experts: int, dtype: type) -> None:
    """The sentinel is the dtype's max, so ids 0..num_experts-1 never reach it."""
    assert routing_dtype_for(num_experts) == np.dtype(dtype)
    cfg = RoutingReplayConfig()
    cfg.postprocess(_model_config(tmp_path, n_routed_experts=num_experts))
    assert cfg.routing_dtype == np.dtype(dtype)
    assert cfg.sentinel == np.iinfo(dtype).max and cfg.sentinel >= num_experts


def test_postprocess_twice_is_an_error(tmp_path: Path) -> None:
    cfg = RoutingReplayConfig()
    model_config = _model_config(tmp_path)
    cfg.postprocess(model_config)
    with pytest.raises(ConfigError, match="called twice"):
        cfg.postprocess(model_config)


def test_postprocess_needs_a_finalized_model_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="finalized ModelConfig"):
        RoutingReplayConfig().postprocess(ModelConfig(model=str(tmp_path)))
