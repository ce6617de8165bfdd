"""The all_layers layout and the weight version, in responses and in both stores: a model with layers
0..3 of which 1 and 3 are MoE (K=2, uint8), delivered without an engine."""

from __future__ import annotations

import numpy as np
import pytest

from fastdeploy_r3.client import read_local_rollout, read_local_rollout_meta, read_redis_rollout_meta, to_moe_layout
from fastdeploy_r3.client.routed_experts import to_megatron_router_replay
from fastdeploy_r3.outputs import CompletionOutput, RequestOutput, WeightVersionSpan, weight_version_spans
from fastdeploy_r3.r3.codec import decode_routed_experts
from fastdeploy_r3.r3.config import RoutingReplayConfig
from fastdeploy_r3.r3.delivery import R3Delivery
from fastdeploy_r3.r3.layouts import R3PayloadError
from fastdeploy_r3.r3.stores import LocalRoutingStore, RedisRoutingStore

ROWS = (np.arange(24, dtype=np.uint8).reshape(6, 2, 2) % 8)  # [6 rows, 2 MoE layers, K=2]


def _config(layout: str = "moe") -> RoutingReplayConfig:
    rr = RoutingReplayConfig(enable_routing_replay=True, routing_layout=layout)
    rr.moe_layer_ids, rr.num_moe_layers, rr.moe_top_k, rr.routing_dtype = [1, 3], 2, 2, np.dtype(np.uint8)
    rr.num_hidden_layers = 4
    return rr


def _final(spans: list[WeightVersionSpan] | None = None) -> RequestOutput:
    """A prompt of 4 tokens and 3 returned ones: rows [0, 6)."""
    spans = spans or [WeightVersionSpan("7", 0, 3)]
    c = CompletionOutput(0, "", [7, 8, 9], "length", routed_experts=ROWS, weight_versions=spans,
                         spans_weight_versions=len(spans) > 1)
    return RequestOutput("cmpl-1", None, [1, 2, 3, 4], [c], finished=True)


def test_all_layers_payload_puts_moe_rows_at_their_layer_ids_and_the_sentinel_elsewhere() -> None:
    r3 = R3Delivery(_config(), None).deliver(_final(), "x", routing_layout="all_layers")
    arr = decode_routed_experts(r3.payloads[0])
    assert r3.layout == "all_layers" and arr.shape == (6, 4, 2) and arr.dtype == np.uint8
    assert (arr[:, [0, 2], :] == 255).all()
    assert np.array_equal(arr[:, [1, 3], :], ROWS)
    assert np.array_equal(to_moe_layout(arr, [1, 3], num_hidden_layers=4), ROWS)
    assert R3Delivery(_config("all_layers"), None).deliver(_final(), "x").layout == "all_layers"  # the default
    assert R3Delivery(_config("all_layers"), None).deliver(_final(), "x", routing_layout="moe").layout == "moe"


def test_readers_take_both_layouts_and_refuse_a_count_that_is_neither() -> None:
    all_layers = decode_routed_experts(R3Delivery(_config("all_layers"), None).deliver(_final(), "x").payloads[0])
    replay = to_megatron_router_replay(all_layers, [1, 3], num_hidden_layers=4)
    assert [t.shape[0] for t in replay] == [7, 7] and replay[1][:6].tolist() == ROWS[:, 1, :].tolist()
    with pytest.raises(R3PayloadError, match=r"expected \[rows, 2, K\] or \[rows, 4, K\]"):
        to_moe_layout(np.zeros((6, 3, 2), np.uint8), [1, 3], num_hidden_layers=4)


def test_local_store_keeps_the_layout_and_the_weight_versions(tmp_path) -> None:
    store = LocalRoutingStore(str(tmp_path), use_fused_put=False)
    spans = [WeightVersionSpan("6", 0, 1), WeightVersionSpan("7", 1, 3)]
    R3Delivery(_config("all_layers"), store).deliver(_final(spans), "d:g:0:0")
    stored = read_local_rollout(str(tmp_path), "d:g:0:0")  # every per-layer file: all four layers
    assert stored.shape == (6, 4, 2) and np.array_equal(stored[:, [1, 3], :], ROWS)
    assert np.array_equal(read_local_rollout(str(tmp_path), "d:g:0:0", moe_layer_ids=[1, 3]), ROWS)
    assert read_local_rollout_meta(str(tmp_path), "d:g:0:0") == {
        "weight_version": "7",
        "weight_versions": [[{"version": "6", "start": 0, "end": 1}, {"version": "7", "start": 1, "end": 3}]],
        "spans_weight_versions": True,
        "routing_layout": "all_layers",
        "layer_ids": [0, 1, 2, 3],
    }
    store.delete("d:g:0:0", [0, 1, 2, 3])
    with pytest.raises(KeyError, match="no R3 meta entry"):
        store.get_meta("d:g:0:0")


def test_redis_store_keeps_the_weight_version(redis_url: str) -> None:
    store = RedisRoutingStore(redis_url, "layouts")
    R3Delivery(_config(), store).deliver(_final(), "rollout-9")
    meta = read_redis_rollout_meta(redis_url, "layouts", "rollout-9")
    assert (meta["weight_version"], meta["routing_layout"], meta["layer_ids"]) == ("7", "moe", [1, 3])
    assert np.array_equal(store.get("rollout-9"), ROWS)
    store.close()


def test_weight_version_spans_of_output_tokens() -> None:
    assert weight_version_spans([], "0", 5) == [WeightVersionSpan("0", 0, 5)]
    assert weight_version_spans([("0", 3)], "1", 6) == [WeightVersionSpan("0", 0, 3), WeightVersionSpan("1", 3, 6)]
    # waiting through an update (no token yet), and a version that sampled nothing, leave no span
    assert weight_version_spans([("0", 0)], "1", 4) == [WeightVersionSpan("1", 0, 4)]
    assert weight_version_spans([("0", 3), ("1", 3)], "2", 5) == [WeightVersionSpan("0", 0, 3),
                                                                   WeightVersionSpan("2", 3, 5)]


def test_unknown_layouts_are_refused_in_the_config_and_per_request() -> None:
    from fastdeploy_r3.config import ConfigError
    from fastdeploy_r3.sampling_params import InvalidRequestError, SamplingParams

    with pytest.raises(ConfigError, match="routing_layout='dense'; use one of moe, all_layers"):
        RoutingReplayConfig.from_json('{"routing_layout": "dense"}')
    with pytest.raises(InvalidRequestError, match="routing_layout='dense'"):
        SamplingParams(routing_layout="dense")
