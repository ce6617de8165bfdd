"""Store health, deadline calls and prefix lookups off the engine loop, against a store that can hang."""

from __future__ import annotations

import threading
import time

import pytest

from fastdeploy_r3.blobstore.health import DeadlineCaller, StoreHealth, StoreUnavailableError
from fastdeploy_r3.cache_manager.storage_lookup import StorageLookup


class HangingStore:
    """Answers exists() from a set of keys; while `hang` is set every call blocks until it is cleared."""

    def __init__(self, keys: set[str]) -> None:
        self.keys = keys
        self.released = threading.Event()
        self.released.set()
        self.calls = 0
        self.closed = 0

    def exists(self, keys: list[str]) -> list[bool]:
        self.calls += 1
        self.released.wait()
        return [k in self.keys for k in keys]

    def close(self) -> None:
        self.closed += 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def wait_answer(lookup: StorageLookup, rid: str, seconds: float = 5.0) -> list[bool]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ans = lookup.answer(rid)
        if ans is not None:
            return ans
        lookup.wait(0.05)
    raise AssertionError(f"lookup of {rid} never answered")


def test_health_degrades_on_failure_probes_once_per_period_and_recovers():
    clock = FakeClock()
    h = StoreHealth("kv storage", retry_after_s=5.0, clock=clock)
    assert h.should_try() and h.degraded is None
    h.failed("ConnectionError: refused")
    clock.now += 1.0
    assert h.degraded == "kv storage degraded for 1.0 s: ConnectionError: refused"
    assert [h.should_try() for _ in range(3)] == [False, False, False]
    clock.now += 4.0
    assert h.should_try() is True  # the probe
    assert h.should_try() is False  # only one per period
    h.ok()
    assert h.degraded is None and h.should_try()
    assert (h.counters.failures, h.counters.skipped, h.counters.recoveries) == (1, 4, 1)


def test_a_call_past_its_deadline_raises_and_later_calls_are_skipped_without_waiting():
    store = HangingStore({"a"})
    caller = DeadlineCaller(StoreHealth("r3 store", retry_after_s=60.0), timeout_s=0.2)
    assert caller.call(store.exists, ["a", "b"]) == [True, False]
    store.released.clear()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=r"r3 store degraded for .* no answer within 0.2 s"):
        caller.call(store.exists, ["a"])
    with pytest.raises(StoreUnavailableError):
        caller.call(store.exists, ["a"])
    assert time.monotonic() - t0 < 1.0  # the second call did not wait another deadline
    assert store.calls == 2
    store.released.set()
    caller.close()


def test_a_burst_queued_behind_each_other_is_not_a_slow_store():
    """Six requests at once, each store call 0.15 s against a 0.2 s deadline: the sixth waits 0.75 s in
    the queue, but the store answered each within its deadline, so all are served and it stays healthy.
    (Before, the queue counted against the deadline: the second call on failed, and the store was
    skipped for everyone until a probe.)"""

    def slow_exists(keys: list[str]) -> list[bool]:
        time.sleep(0.15)
        return [True for _ in keys]

    caller = DeadlineCaller(StoreHealth("r3 store", retry_after_s=60.0), timeout_s=0.2)
    answers: list[object] = []
    threads = [threading.Thread(target=lambda: answers.append(caller.call(slow_exists, ["a"]))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [[True]] * 6
    assert caller.health.degraded is None and caller.health.counters.failures == 0
    caller.close()


def test_a_call_queued_behind_a_stuck_one_gives_up_at_the_stuck_calls_deadline():
    store = HangingStore({"a"})
    store.released.clear()
    caller = DeadlineCaller(StoreHealth("r3 store", retry_after_s=60.0), timeout_s=0.3)
    outcomes: list[str] = []

    def call() -> None:
        try:
            caller.call(store.exists, ["a"])
            outcomes.append("answered")
        except StoreUnavailableError:
            outcomes.append("unavailable")

    t0 = time.monotonic()
    first = threading.Thread(target=call)
    first.start()
    while store.calls == 0:  # the first call holds the store's thread
        time.sleep(0.01)
    queued = threading.Thread(target=call)
    queued.start()
    first.join()
    queued.join()
    assert outcomes == ["unavailable", "unavailable"]
    assert time.monotonic() - t0 < 1.5  # neither waited for the stuck call to end
    assert store.calls == 1  # the queued call never reached the store
    store.released.set()
    caller.close()


def test_a_call_queued_when_the_caller_closes_is_unavailable_not_cancelled():
    """close() cancels the calls still queued (the R3 store's /health probe can be one of them): each gets
    StoreUnavailableError like any call the store did not answer, never a bare CancelledError."""
    store = HangingStore({"a"})
    store.released.clear()
    caller = DeadlineCaller(StoreHealth("r3 store", retry_after_s=60.0), timeout_s=5.0)
    outcomes: list[str] = []

    def call() -> None:
        try:
            caller.call(store.exists, ["a"])
            outcomes.append("answered")
        except StoreUnavailableError as e:
            outcomes.append(f"unavailable: {e}")
        except BaseException as e:  # noqa: BLE001 - what the test is about
            outcomes.append(type(e).__name__)

    first = threading.Thread(target=call)
    first.start()
    while store.calls == 0:  # the first call holds the store's thread
        time.sleep(0.01)
    queued = threading.Thread(target=call)
    queued.start()
    time.sleep(0.2)  # queued behind the stuck call
    caller.close()
    queued.join(timeout=3)
    assert outcomes == ["unavailable: r3 store is closed"]
    store.released.set()
    first.join(timeout=3)
    assert outcomes[1:] == ["answered"]


def test_a_stopped_store_costs_one_deadline_not_one_per_queued_call():
    """Redis stopped: each call blocks until its socket timeout (here the deadline) and then raises. Six
    requests at once: the first takes the deadline and marks the store slow; the five queued behind it are
    not run (before, each ran in turn and took a deadline of its own: six deadlines for the last one)."""
    calls = []

    def stopped(keys: list[str]) -> list[bool]:
        calls.append(keys)
        time.sleep(0.3)
        raise ConnectionError("redis at redis://127.0.0.1:1/0: Timeout reading from socket")

    caller = DeadlineCaller(StoreHealth("r3 store", retry_after_s=60.0), timeout_s=0.3)
    outcomes: list[str] = []

    def call() -> None:
        try:
            caller.call(stopped, ["a"])
        except (ConnectionError, StoreUnavailableError) as e:
            outcomes.append(type(e).__name__)

    t0 = time.monotonic()
    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - t0 < 0.9 and len(calls) == 1
    assert sorted(outcomes) == ["ConnectionError"] + ["StoreUnavailableError"] * 5
    assert caller.health.skipping() and caller.health.counters.failures == 1
    caller.close()


def test_a_call_that_fails_fast_degrades_the_store_but_the_next_call_still_tries_it():
    """A refusal costs nothing to retry: /health says degraded, and the first success heals it."""
    outcomes = [ConnectionError("redis at redis://127.0.0.1:1/0 refused"), [True]]

    def flaky(keys: list[str]) -> list[bool]:
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    caller = DeadlineCaller(StoreHealth("r3 store", retry_after_s=60.0), timeout_s=1.0)
    with pytest.raises(ConnectionError):
        caller.call(flaky, ["a"])
    assert "ConnectionError: redis at redis://127.0.0.1:1/0 refused" in caller.health.degraded
    assert caller.call(flaky, ["a"]) == [True]
    assert caller.health.degraded is None
    caller.close()


def test_lookups_answer_from_the_thread_and_the_lookup_closes_its_store_once():
    store = HangingStore({"k1", "k2"})
    lookup = StorageLookup(store, deadline_s=5.0, health=StoreHealth("kv storage"))
    lookup.start("r1", ["k1", "k2", "k3"])
    assert wait_answer(lookup, "r1") == [True, True, False]
    assert not lookup.has("r1")  # answered once, then forgotten
    lookup.close()
    lookup.close()
    assert store.closed == 1 and not lookup._thread.is_alive()


def test_found_keeps_a_requests_answer_and_counts_our_own_recent_puts():
    """r1's lookup answers [k1 stored, k2 not]; then our put of k2 lands: r1's kept answer now finds
    both, until the store is degraded (its answers, and our puts to it, are not trusted then)."""
    store = HangingStore({"k1"})
    health = StoreHealth("kv storage")
    lookup = StorageLookup(store, deadline_s=5.0, health=health, remember_stored=1)
    deadline = time.monotonic() + 5.0
    while (found := lookup.found("r1", ["k1", "k2"])) is None and time.monotonic() < deadline:
        lookup.wait(0.05)
    assert found == [True, False] and store.calls == 1
    lookup.stored(["k2"])
    assert lookup.found("r1", ["k1", "k2"]) == [True, True] and store.calls == 1  # kept, not asked again
    lookup.stored(["k3"])  # remembers one key: k2 is forgotten
    assert lookup.found("r1", ["k1", "k2"]) == [True, False]
    lookup.stored(["k2"])
    health.failed("ConnectionError: refused")
    assert lookup.found("r1", ["k1", "k2"]) == [True, False]
    lookup.forget("r1")
    assert lookup.found("r1", ["k1", "k2"]) == [False, False]  # asked again: degraded answers at once
    lookup.close()


def test_a_hanging_store_answers_missing_at_the_deadline_and_then_at_once_until_it_recovers():
    """The store hangs: r1 waits its deadline (0.3 s) and misses; r2 misses at once; the store recovers."""
    store = HangingStore({"k1"})
    health = StoreHealth("kv storage", retry_after_s=0.5)
    lookup = StorageLookup(store, deadline_s=0.3, health=health)
    store.released.clear()
    lookup.start("r1", ["k1"])
    assert lookup.answer("r1") is None  # still within its deadline
    time.sleep(0.35)
    assert lookup.answer("r1") == [False]
    assert "a prefix lookup did not answer within 0.3 s" in health.degraded
    lookup.start("r2", ["k1"])
    assert lookup.answer("r2") == [False]  # degraded: no wait at all
    store.released.set()
    time.sleep(0.55)  # past retry_after_s: the next lookup is a probe
    lookup.start("r3", ["k1"])
    assert wait_answer(lookup, "r3") == [True]
    assert health.degraded is None
    lookup.close()


def test_a_store_that_raises_is_a_miss_and_degraded():
    class Broken:
        def exists(self, keys: list[str]) -> list[bool]:
            raise TimeoutError("Timeout reading from socket")

        def close(self) -> None:
            pass

    health = StoreHealth("kv storage")
    lookup = StorageLookup(Broken(), deadline_s=5.0, health=health)
    lookup.start("r1", ["k1", "k2"])
    assert wait_answer(lookup, "r1") == [False, False]
    assert "TimeoutError: Timeout reading from socket" in health.degraded
    lookup.close()


def test_an_answer_nobody_asked_for_is_an_error():
    lookup = StorageLookup(HangingStore(set()), deadline_s=1.0, health=StoreHealth("kv storage"))
    with pytest.raises(KeyError, match="no storage lookup was started for request 'x'"):
        lookup.answer("x")
    lookup.close()
