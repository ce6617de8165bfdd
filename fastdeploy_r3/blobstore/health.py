"""The health of one store (KV storage tier, R3 store) as its callers have seen it lately.

    healthy ──failure──► degraded ──retry_after_s──► one probe ──success──► healthy
                            ▲                            │
                            └──────────failure───────────┘

While a store is degraded because it was slow (a call missed its deadline) its callers do not wait
on it: a KV lookup or load is a miss at once, an R3 put fails its request at once with the reason,
and one call every `retry_after_s` probes whether the store is back; so a store that hangs costs one
deadline per `retry_after_s`, not one per request. A store that failed fast (refused, disk full) is
degraded too, for /health, but costs nothing to try, so every call still tries it and the first
success heals it. Thread-safe: the engine loop, lookup threads and the API
server's delivery threads share one instance per store.

DeadlineCaller runs each blocking store call on the store's own thread and stops waiting at the
deadline (the call itself cannot be interrupted). The deadline is the store's time: it starts when the
call starts on that thread, not when it was queued, so a burst of requests queued behind each other
on a busy machine does not read as a slow store. A failure that took half the deadline or more (a
socket timeout) is slow too; the outcome is recorded on the store's thread before the next queued
call starts, and a queued call finding the store slow is not run: a stopped store costs one
deadline, not one per queued call. A queued caller also gives up when the call ahead of it is past
its own deadline (a call that hangs for good), and calls made while the store is degraded are
skipped, so stuck calls do not pile up. An answer already in hand when a deadline fires (the
process was stopped or starved while the store answered) is taken: the caller looks once more after
a short grace before it blames the store.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)


class StoreUnavailableError(RuntimeError):
    """The store is degraded (or did not answer in time); the message says since when and why."""


@dataclass
class StoreHealthCounters:
    failures: int = 0  # calls that raised or missed their deadline
    skipped: int = 0  # calls not attempted because the store was degraded
    recoveries: int = 0  # degraded -> healthy


class StoreHealth:
    def __init__(self, name: str, retry_after_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._skip = True  # the failure was slow: skip the store until a probe
        self._since = 0.0
        self._next_probe = 0.0
        self.counters = StoreHealthCounters()

    @property
    def degraded(self) -> str | None:
        """None when healthy, else what failed and for how long (for /health and error messages)."""
        with self._lock:
            if self._reason is None:
                return None
            return f"{self.name} degraded for {self._clock() - self._since:.1f} s: {self._reason}"

    def skipping(self) -> bool:
        """Degraded by a slow failure: calls other than the due probe are not tried."""
        with self._lock:
            return self._reason is not None and self._skip

    def should_try(self) -> bool:
        """True when a call may go to the store: it is healthy, or degraded and due a probe."""
        with self._lock:
            if self._reason is None or not self._skip:
                return True
            now = self._clock()
            if now >= self._next_probe:
                self._next_probe = now + self.retry_after_s
                return True
            self.counters.skipped += 1
            return False

    def ok(self) -> None:
        with self._lock:
            if self._reason is not None:
                self.counters.recoveries += 1
            self._reason = None

    def failed(self, reason: str, slow: bool = True) -> None:
        """Record a failure; `slow` (it took a deadline, or may have) makes callers skip the store until a probe."""
        with self._lock:
            now = self._clock()
            self.counters.failures += 1
            if self._reason is None:
                self._since = now
            self._reason = reason
            self._skip = slow
            self._next_probe = now + self.retry_after_s

    def unavailable(self) -> StoreUnavailableError:
        return StoreUnavailableError(self.degraded or f"{self.name} is unavailable")


class DeadlineCaller:
    """One thread per store that runs its blocking calls; callers wait at most a deadline of the store's time."""

    grace_s = 0.25  # after a deadline: time for an answer already in hand to be taken (see the module doc)
    poll_s = 0.05  # how often a queued caller looks whether the call ahead of it is stuck

    def __init__(self, health: StoreHealth, timeout_s: float) -> None:
        self.health = health
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fdr3-{health.name}")
        self._running_since: float | None = None  # when the store thread's current call started

    def call(
        self,
        fn: Callable[..., T],
        *args: object,
        undo: Callable[[], object] | None = None,
        answers: tuple[type[Exception], ...] = (),
    ) -> T:
        """fn(*args) on the store's thread. Raises StoreUnavailableError when the store is degraded or the
        call misses the deadline, and re-raises what fn raised (both mark the store degraded, except
        `answers`: errors that are the store's answer, such as "that key is taken", not its failure).

        undo: run on the store's thread if fn completes after all, once its caller gave up on it (a put
        that was reported as failed must not stay stored)."""
        probe = self.health.skipping()  # admitted while skipping: this call is the due probe
        if not self.health.should_try():
            raise self.health.unavailable()
        started: list[float] = []
        fut = self._pool.submit(self._run, started, probe, answers, fn, *args)
        try:
            return self._result(fut, started)
        except concurrent.futures.CancelledError:  # close() cancelled it in the queue: not the store's failure
            raise StoreUnavailableError(f"{self.health.name} is closed") from None
        except concurrent.futures.TimeoutError:
            self.health.failed(f"no answer within {self.timeout_s:g} s")
            if undo is not None:
                fut.add_done_callback(lambda f: _undo_late(f, undo))
            raise self.health.unavailable() from None

    def _run(self, started: list[float], probe: bool, answers: tuple[type[Exception], ...],
             fn: Callable[..., T], *args: object) -> T:
        """On the store's thread. A call that waited in the queue while the store turned slow is not run
        (the probe is); the outcome is recorded here, before the next queued call starts, so a store that
        hangs costs the calls behind it nothing. A failure that took half the deadline or more is slow."""
        if not probe and self.health.skipping():
            raise self.health.unavailable()
        self._running_since = t0 = time.monotonic()
        started.append(t0)
        try:
            result = fn(*args)
        except answers:
            self.health.ok()
            raise
        except Exception as e:
            self.health.failed(f"{type(e).__name__}: {e}", slow=time.monotonic() - t0 >= self.timeout_s / 2)
            raise
        finally:
            self._running_since = None
        if time.monotonic() - t0 <= self.timeout_s:  # a late answer heals nothing: its caller gave up
            self.health.ok()
        return result

    def _result(self, fut: concurrent.futures.Future, started: list[float]) -> T:
        """fut's result within timeout_s of its start; TimeoutError when it misses that, or when it is still
        queued behind a call that missed its own."""
        overdue: tuple[float, float] | None = None  # (the call ahead's start, when it was first seen overdue)
        while not started and not fut.done():
            ahead, now = self._running_since, time.monotonic()
            if ahead is None or now - ahead <= self.timeout_s:
                overdue = None
            elif overdue is None or overdue[0] != ahead:
                overdue = (ahead, now)  # give it the grace: after a stop of this process it is just resuming
            elif now - overdue[1] >= self.grace_s and fut.cancel():
                raise concurrent.futures.TimeoutError
            try:
                return fut.result(timeout=self.poll_s)
            except concurrent.futures.TimeoutError:
                continue
        remaining = started[0] + self.timeout_s - time.monotonic() if started else 0.0
        try:
            return fut.result(timeout=max(remaining, 0.0))
        except concurrent.futures.TimeoutError:
            return fut.result(timeout=self.grace_s)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _undo_late(fut: concurrent.futures.Future, undo: Callable[[], object]) -> None:
    if fut.cancelled() or fut.exception() is not None:
        return
    try:
        undo()
    except Exception:  # noqa: BLE001 - best effort: the store may be gone again
        logger.warning("could not take back a store call that completed after its deadline", exc_info=True)
