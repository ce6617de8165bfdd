"""Every R3 write is conditional: one writer per rollout id across stores that share a directory, a
redis-server or a Mooncake cluster; create-only unless overwrite, and an overwrite replaces the whole
rollout, choice count included (r3/reservation.py)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from fastdeploy_r3.r3.reservation import (
    Reservation,
    ReservationLostError,
    RolloutExistsError,
    RolloutReservedError,
)
from fastdeploy_r3.r3.stores import LocalRoutingStore, RedisRoutingStore, RoutingStore
from fastdeploy_r3.r3.stores.mooncake import MooncakeRoutingStore

LAYERS = [1, 2]


def rows(seed: int, t: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 8, size=(t, len(LAYERS), 2), dtype=np.uint8)  # [T, L, K]


@pytest.fixture(params=["local", "redis", "mooncake"])
def two_stores(request, tmp_path) -> Iterator[tuple[RoutingStore, RoutingStore]]:
    """Two stores, as two servers would open them, over one shared place."""
    kind = request.param
    ns = f"cw{time.monotonic_ns()}"  # a fresh namespace per test: the redis-server is the session's
    if kind == "local":
        yield LocalRoutingStore(str(tmp_path)), LocalRoutingStore(str(tmp_path))
        return
    if kind == "redis":
        url = request.getfixturevalue("redis_url")
        make: Callable[[], RoutingStore] = lambda: RedisRoutingStore(url, ns, ttl_s=60)  # noqa: E731
    else:
        url = request.getfixturevalue("mooncake_store_url")
        make = lambda: MooncakeRoutingStore(url, ns)  # noqa: E731
    a, b = make(), make()
    yield a, b
    a.close()
    b.close()


def test_a_reserved_id_is_refused_to_a_second_server_until_given_back(two_stores) -> None:
    a, b = two_stores
    mine = a.reserve("r1", 30, overwrite=False, moe_layer_ids=LAYERS)
    with pytest.raises(RolloutReservedError, match="another request"):
        b.reserve("r1", 30, overwrite=True, moe_layer_ids=LAYERS)  # overwrite does not break a live hold
    a.put("r1", [rows(0)], LAYERS, reservation=mine)
    a.unreserve(mine)
    with pytest.raises(RolloutExistsError, match="overwrite_rollout"):
        b.reserve("r1", 30, overwrite=False, moe_layer_ids=LAYERS)
    theirs = b.reserve("r1", 30, overwrite=True, moe_layer_ids=LAYERS)
    b.put("r1", [rows(1)], LAYERS, overwrite=True, reservation=theirs)
    assert np.array_equal(a.get("r1"), rows(1))


def test_concurrent_reservations_of_one_id_have_exactly_one_winner(two_stores) -> None:
    a, b = two_stores
    won: list[Reservation] = []
    refused: list[str] = []
    gate = threading.Barrier(8)

    def contend(store: RoutingStore) -> None:
        gate.wait()
        try:
            won.append(store.reserve("race", 30, overwrite=False, moe_layer_ids=LAYERS))
        except RolloutReservedError as e:
            refused.append(str(e))

    threads = [threading.Thread(target=contend, args=(s,)) for s in [a, b] * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == 7


def test_a_create_only_put_never_replaces_a_stored_rollout(two_stores) -> None:
    a, b = two_stores
    a.put("r2", [rows(0)], LAYERS)
    with pytest.raises(RolloutExistsError):
        b.put("r2", [rows(1)], LAYERS)
    with pytest.raises(RolloutExistsError):  # nor with another n: choice ids are the same rollout
        b.put("r2", [rows(1), rows(2)], LAYERS)
    assert np.array_equal(b.get("r2"), rows(0))


def test_a_writer_whose_hold_was_taken_over_fails_at_put(two_stores) -> None:
    """A's lock expired (as if its server had died); B took the id over: A's late put is refused."""
    a, b = two_stores
    stale = a.reserve("r3", 0.01, overwrite=False, moe_layer_ids=LAYERS)
    time.sleep(0.02)
    if isinstance(a, RedisRoutingStore):  # Redis expires keys by itself; a whole second is its least ttl
        a.blobs.delete([a.lock_key("r3")])
    fresh = b.reserve("r3", 30, overwrite=False, moe_layer_ids=LAYERS)
    with pytest.raises(ReservationLostError, match="taken by another writer"):
        a.put("r3", [rows(0)], LAYERS, reservation=stale)
    b.put("r3", [rows(1)], LAYERS, reservation=fresh)
    a.unreserve(stale)  # not A's any more: B's lock stays
    assert b.holder("r3") == fresh
    assert np.array_equal(a.get("r3"), rows(1))


@pytest.mark.parametrize("fused", [True, False])
def test_overwrite_with_another_n_leaves_no_old_choice_readable(two_stores, fused: bool) -> None:
    a, _ = two_stores
    a.use_fused_put = fused
    layers = None if fused else LAYERS
    a.put("r4", [rows(0)], LAYERS, meta={"n": 1})
    a.put("r4", [rows(1), rows(2)], LAYERS, meta={"n": 2}, overwrite=True)  # n = 1 -> 2
    with pytest.raises(KeyError):
        a.get("r4", moe_layer_ids=layers)  # the n = 1 array is gone
    assert np.array_equal(a.get("r4", choice=1, moe_layer_ids=layers), rows(2))
    a.put("r4", [rows(3)], LAYERS, meta={"n": 1}, overwrite=True)  # n = 2 -> 1
    for choice in (0, 1):
        with pytest.raises(KeyError):
            a.get("r4", choice=choice, moe_layer_ids=layers)
    assert np.array_equal(a.get("r4", moe_layer_ids=layers), rows(3))
    assert a.get_meta("r4") == {"n": 1}


def test_a_torn_local_lock_of_a_dead_writer_is_taken_over(tmp_path) -> None:
    """A server killed while writing its lock leaves bytes that are no reservation: the next writer takes the id."""
    store = LocalRoutingStore(str(tmp_path))
    (tmp_path / ".r5#lock").write_bytes(b'{"tok')
    mine = store.reserve("r5", 30, overwrite=False, moe_layer_ids=LAYERS)
    assert json.loads((tmp_path / ".r5#lock").read_bytes())["token"] == mine.token
    store.put("r5", [rows(0)], LAYERS, reservation=mine)
    store.unreserve(mine)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r5.npy"]  # the lock went with the request
