"""Prefix lookups in the KV storage tier, off the engine loop.

    engine loop                                   lookup thread
      start(rid, keys)  ── queue ──────────────►    storage.exists(keys)
      answer(rid) → None      (still running)            │
                  → [bool]    (answered) ◄───────────────┘
                  → [False]*n (deadline passed, store degraded, or it raised)

A waiting request is admitted once its lookup has answered; every other request keeps stepping in
the meantime, so a slow or stopped store (Redis under SIGSTOP, a hung mount) costs the requests that
wanted it at most `deadline_s` and costs nobody else anything. A lookup that misses its deadline
marks the store degraded (blobstore/health.py): later lookups answer "all missing" at once, except one
probe every `retry_after_s`, until the store answers again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from fastdeploy_r3.blobstore.health import StoreHealth

logger = logging.getLogger(__name__)


class ExistsStore(Protocol):
    def exists(self, keys: list[str]) -> list[bool]: ...


@dataclass
class _Lookup:
    keys: list[str]
    started: float
    result: list[bool] | None = None


class StorageLookup:
    def __init__(
        self,
        storage: ExistsStore,
        deadline_s: float,
        health: StoreHealth,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.storage = storage
        self.deadline_s = deadline_s
        self.health = health
        self._clock = clock
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)
        self._lookups: dict[str, _Lookup] = {}
        self._queue: queue.SimpleQueue[tuple[str, _Lookup] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="fdr3-storage-lookup", daemon=True)
        self._thread.start()

    def start(self, request_id: str, keys: list[str]) -> None:
        """Look up `keys` for a request (replacing an earlier lookup of the same request)."""
        job = _Lookup(list(keys), self._clock())
        if not keys or not self.health.should_try():
            job.result = [False] * len(keys)
        with self._lock:
            self._lookups[request_id] = job
        if job.result is None:
            self._queue.put((request_id, job))

    def pending(self) -> bool:
        """Some lookup has not answered yet."""
        with self._lock:
            return any(j.result is None for j in self._lookups.values())

    def has(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._lookups

    def answer(self, request_id: str) -> list[bool] | None:
        """The lookup's answer (one bool per key) and forget it; None while it may still answer in time."""
        with self._lock:
            job = self._lookups.get(request_id)
            if job is None:
                raise KeyError(f"no storage lookup was started for request {request_id!r}")
            if job.result is None:
                if self._clock() - job.started < self.deadline_s:
                    return None
                job.result = [False] * len(job.keys)
                late = True
            else:
                late = False
            del self._lookups[request_id]
        if late:
            self.health.failed(f"a prefix lookup did not answer within {self.deadline_s:g} s")
            logger.warning("storage lookup of %s timed out; its prefix is computed instead", request_id)
        return job.result

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._lookups.pop(request_id, None)

    def wait(self, timeout_s: float) -> None:
        """Block until some pending lookup answers or `timeout_s` passes (an idle engine does not spin)."""
        with self._answered:
            if any(j.result is not None for j in self._lookups.values()):
                return
            self._answered.wait(timeout_s)

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            request_id, job = item
            with self._lock:
                if self._lookups.get(request_id) is not job or self._clock() - job.started >= self.deadline_s:
                    continue  # forgotten, replaced, or already answered "missing" at its deadline
            try:
                found = [bool(x) for x in self.storage.exists(job.keys)]
                if len(found) != len(job.keys):
                    raise ValueError(f"exists() answered {len(found)} values for {len(job.keys)} keys")
            except Exception as e:  # noqa: BLE001 - any store failure is a miss, never an engine failure
                self.health.failed(f"{type(e).__name__}: {e}")
                found = [False] * len(job.keys)
            else:
                if getattr(self.storage, "health", None) is not self.health:
                    # a store that keeps this health itself (KVStorageBackend) has recorded the outcome
                    # already, failures it answered as misses included
                    self.health.ok()
            with self._answered:
                if job.result is None:
                    job.result = found
                self._answered.notify_all()
