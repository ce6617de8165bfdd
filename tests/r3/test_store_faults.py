"""R3 stores under faults: a per-layer local put is all-or-nothing, and a stopped p2pstore costs each
request one clear error within store_timeout_s, then none of the waiting, until it answers again."""

from __future__ import annotations

import errno
import os
import signal
import time

import numpy as np
import pytest
from redis_server import redis_pid, redis_server

from fastdeploy_r3.blobstore import base as blob_base
from fastdeploy_r3.blobstore import local as blob_local
from fastdeploy_r3.outputs import CompletionOutput, RequestOutput
from fastdeploy_r3.r3.config import RoutingReplayConfig
from fastdeploy_r3.r3.delivery import R3Delivery, R3StoreFailedError
from fastdeploy_r3.r3.stores import LocalRoutingStore, RedisRoutingStore, RoutingStoreError

LAYERS = [1, 2, 3]


def rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 8, size=(5, len(LAYERS), 2)).astype(np.uint8)  # [T, L, K]


def disk_full_after(monkeypatch: pytest.MonkeyPatch, n_files: int) -> None:
    """The blob store's file creations fail with ENOSPC from the (n_files + 1)-th on."""
    real_open, opened = blob_base.open_new_private, [0]

    def fake_open(path: str):
        opened[0] += 1
        if opened[0] > n_files:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_open(path)

    # write_atomic (base.py) and the per-layer staging directory (local.py) both create files through it
    monkeypatch.setattr(blob_base, "open_new_private", fake_open)
    monkeypatch.setattr(blob_local, "open_new_private", fake_open)


def test_a_per_layer_put_that_fails_halfway_leaves_nothing_a_reader_can_see(tmp_path, monkeypatch) -> None:
    """n=2, per-layer files: the disk fills at the 4th of 6 files; neither choice appears, no temp is left."""
    store = LocalRoutingStore(str(tmp_path), use_fused_put=False)
    disk_full_after(monkeypatch, 3)
    with pytest.raises(RoutingStoreError, match="No space left on device"):
        store.put("r", [rows(0), rows(1)], LAYERS)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == []
    with pytest.raises(KeyError):
        store.get("r", choice=0)


def test_a_failed_overwrite_keeps_the_whole_rollout_that_was_there(tmp_path, monkeypatch) -> None:
    store = LocalRoutingStore(str(tmp_path), use_fused_put=False)
    store.put("r", [rows(0)], LAYERS)
    disk_full_after(monkeypatch, 2)
    with pytest.raises(RoutingStoreError):
        store.put("r", [rows(1)], LAYERS)
    monkeypatch.undo()
    assert np.array_equal(store.get("r", moe_layer_ids=LAYERS), rows(0))
    assert sorted(os.listdir(tmp_path)) == ["r.layers"]
    store.put("r", [rows(2)], LAYERS)  # and a later overwrite replaces it whole
    assert np.array_equal(store.get("r", moe_layer_ids=LAYERS), rows(2))
    assert sorted(os.listdir(tmp_path)) == ["r.layers"]


def _final() -> RequestOutput:
    """A prompt of 3 tokens and 3 returned tokens: rows [0, 5)."""
    return RequestOutput("cmpl-1", None, [1, 2, 3], [CompletionOutput(0, "", [7, 8, 9], "length",
                                                                      routed_experts=rows(0))], finished=True)


def test_a_stopped_p2pstore_fails_puts_clearly_within_the_deadline_then_at_once() -> None:
    rr = RoutingReplayConfig(enable_routing_replay=True, routing_store_type="p2pstore", store_timeout_s=0.5)
    rr.moe_layer_ids, rr.num_moe_layers, rr.moe_top_k, rr.routing_dtype = LAYERS, 3, 2, np.dtype(np.uint8)
    with redis_server() as url:
        rr.p2pstore_url = url
        delivery = R3Delivery(rr, RedisRoutingStore(url, "ns", timeout_s=5.0))
        delivery.health.retry_after_s = 0.3  # probe again after 0.3 s rather than 5 s
        delivery.deliver(_final(), "before")
        assert delivery.store_problem() is None
        pid = redis_pid(url)
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(R3StoreFailedError, match=r"rollout 'during' failed: the R3 store did not take it "
                                                         r"\(r3 store degraded for .* no answer within 0.5 s\)"):
                delivery.deliver(_final(), "during")
            assert time.monotonic() - t0 < 2.0
            t1 = time.monotonic()
            with pytest.raises(R3StoreFailedError):
                delivery.deliver(_final(), "during2")
            assert time.monotonic() - t1 < 0.1  # degraded: no second wait
            assert "no answer within 0.5 s" in delivery.store_problem()
        finally:
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.4)
        delivery.deliver(_final(), "after")
        assert delivery.store_problem() is None
        # the put of "during" that landed after its deadline was taken back: its request failed
        with pytest.raises(KeyError):
            delivery.store.get("during")
        delivery.close()
