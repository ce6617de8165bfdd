"""R3Delivery: one fail-closed policy for the server and offline LLM, checked without an engine."""

from __future__ import annotations

import numpy as np
import pytest

from fastdeploy_r3.outputs import CompletionOutput, RequestOutput
from fastdeploy_r3.r3.codec import decode_routed_experts
from fastdeploy_r3.r3.config import RoutingReplayConfig
from fastdeploy_r3.r3.delivery import R3Delivery, R3DeliveryError, R3StoreFailedError
from fastdeploy_r3.r3.rollout_id import InvalidRolloutIdError, resolve_rollout_id
from fastdeploy_r3.r3.stores import LocalRoutingStore, RedisRoutingStore


def _config() -> RoutingReplayConfig:
    """2 MoE layers (ids 1 and 3), K=2, uint8 rows."""
    rr = RoutingReplayConfig(enable_routing_replay=True)
    rr.moe_layer_ids, rr.num_moe_layers, rr.moe_top_k, rr.routing_dtype = [1, 3], 2, 2, np.dtype(np.uint8)
    return rr


def _final(rows: list[np.ndarray | None], start: int = 0) -> RequestOutput:
    """A prompt of 4 tokens and 3 returned tokens per choice: rows [start, 6)."""
    outs = [CompletionOutput(i, "", [7, 8, 9], "length", routed_experts=r, routed_experts_start=start)
            for i, r in enumerate(rows)]
    return RequestOutput("cmpl-1", None, [1, 2, 3, 4], outs, finished=True)


def test_rollout_id_rule_never_falls_back_to_a_constant() -> None:
    assert resolve_rollout_id("d:g:0:1", "alice", "cmpl-1") == "d:g:0:1"
    assert resolve_rollout_id(None, "alice", "cmpl-1") == "alice"
    assert resolve_rollout_id(None, None, "cmpl-1") == "cmpl-1"
    with pytest.raises(InvalidRolloutIdError, match="user"):
        resolve_rollout_id(None, "a b", "cmpl-1")


def test_response_mode_encodes_every_choice_after_checking_it() -> None:
    rows = np.arange(24, dtype=np.uint8).reshape(6, 2, 2) % 8
    r3 = R3Delivery(_config(), None).deliver(_final([rows, rows[::-1].copy()]), "ignored")
    assert r3.starts == [0, 0]
    assert decode_routed_experts(r3.payloads[1]).tolist() == rows[::-1].tolist()
    assert r3.payload_bytes == sum(len(p) for p in r3.payloads)
    assert R3Delivery(_config(), None).deliver(_final([rows]), "x", inline=False).payloads == [None]


def test_missing_short_or_holed_rows_fail_the_request() -> None:
    delivery = R3Delivery(_config(), None)
    with pytest.raises(R3DeliveryError, match="no routed_experts of choice 1 of cmpl-1"):
        delivery.deliver(_final([np.zeros((6, 2, 2), np.uint8), None]), "x")
    with pytest.raises(R3DeliveryError, match=r"shape \[5, 2, 2\] uint8; expected \[6, 2, 2\]"):
        delivery.deliver(_final([np.zeros((5, 2, 2), np.uint8)]), "x")
    holed = np.zeros((4, 2, 2), np.uint8)
    holed[1, 1, 0] = 255
    with pytest.raises(R3DeliveryError, match="row 3 layer 3 holds the no-route sentinel"):
        delivery.deliver(_final([holed], start=2), "x")


def test_store_mode_puts_under_the_rollout_id_or_fails(tmp_path) -> None:
    rows = np.ones((6, 2, 2), np.uint8)
    r3 = R3Delivery(_config(), LocalRoutingStore(str(tmp_path))).deliver(_final([rows]), "d:g:0:0")
    assert r3.payloads == [None] and r3.starts == [0]
    assert LocalRoutingStore(str(tmp_path)).get("d:g:0:0").tolist() == rows.tolist()
    dead = R3Delivery(_config(), RedisRoutingStore("redis://127.0.0.1:1/0", "ns"))
    with pytest.raises(R3StoreFailedError, match="storing routed_experts of rollout 'r' failed"):
        dead.deliver(_final([rows]), "r")
