"""The engine's cache transfer manager (CTM) over its whole life: started with the engine, the one
way the tiers behind it (cpu_tier.py, storage_tier.py) talk to it, replaced when it dies or gets
stuck, and never waited for by the engine loop once the engine is up.

    running ──dies, or an ack misses timeout_s──► lost: the tiers skip it (their lookups find
       ▲                                          │      nothing), what it held becomes misses
       │                                          ▼
       └──────── ready ◄─── starting ◄─── killed, a new one launched (a store that is down
                               │                 does not keep it from starting: it starts degraded)
                               └── setup failed, or not up within 300 s ──► none: GPU cache only,
                                                                           /health says why
The tiers subscribe: they hear `transfer_lost()` when it goes and `transfer_replaced(available)`
when a new one is adopted (its CPU tier is empty) or none will come.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Protocol

from fastdeploy_r3.cache_manager.cache_transfer_client import CacheTransferClient, TransferStats
from fastdeploy_r3.cache_manager.transfer import (
    CacheTransferConfig,
    CacheTransferError,
    RemoteBlocks,
    TransferAck,
    TransferKind,
    TransferTask,
)

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # a replacement that is not up by then: serve without tiers


class TransferClient(Protocol):
    """A running CTM (CacheTransferClient). A test's fake needs only what its scenario calls: submit,
    poll and wait for the tiers (and wait_any, if it has one, for an engine waiting on loads); the rest for
    tick(), stop() and the metrics."""

    pid: int | None
    stats: TransferStats

    def submit(self, task: TransferTask) -> None: ...

    def poll(self) -> list[TransferAck]: ...

    def wait(self, task_id: int, timeout: float | None = 60) -> TransferAck: ...

    def is_alive(self) -> bool: ...

    def kill(self) -> None: ...

    def shutdown(self) -> None: ...


class TransferUser(Protocol):
    """A tier behind the CTM."""

    def transfer_lost(self) -> None: ...

    def transfer_replaced(self, available: bool) -> None: ...


class TransferSupervisor:
    def __init__(self, config: CacheTransferConfig | None, timeout_s: float = 60.0,
                 client: TransferClient | None = None) -> None:  # fmt: skip
        """config: how to start (and restart) the CTM; client: one already running (tests), else start()."""
        self.config = config
        self.timeout_s = timeout_s  # an ack later than this: the CTM is stuck
        self.client: TransferClient | None = client  # the running CTM
        self.lost: str | None = None  # why the running CTM is unusable, until it is replaced
        self.replacements = 0
        self.transfers_lost = 0  # times the CTM was found dead or stuck
        self.failed: str | None = None  # why the engine serves without a CTM, once it gave up
        self._users: list[TransferUser] = []
        self._next_task_id = 1
        self._starting: CacheTransferClient | None = None
        self._starting_since = 0.0

    @property
    def usable(self) -> bool:
        return self.client is not None and self.lost is None

    @property
    def store_counters(self) -> dict[str, int]:
        return dict(self.client.stats.store_counters) if self.client is not None else {}

    def subscribe(self, user: TransferUser) -> None:
        self._users.append(user)

    def start(self) -> None:
        """The first CTM, at engine start (blocking: a store that is down fails the start clearly)."""
        assert self.config is not None, "TransferSupervisor.start() needs the CTM's config"
        client = CacheTransferClient()
        client.start(self.config)
        self.client = client

    # -- tasks --------------------------------------------------------------------------------------

    def submit(self, kind: TransferKind, gpu: list[int], cpu: list[int] | None = None,
               keys: list[str] | None = None, tags: list[int] | None = None,
               remote: RemoteBlocks | None = None, first_block: int = 0,
               tail_tokens: int = 0) -> int | None:  # fmt: skip
        """Queue a task; its id, or None when there is no usable CTM (now marked lost if it just went)."""
        if not self.usable:
            return None
        assert self.client is not None
        task_id, self._next_task_id = self._next_task_id, self._next_task_id + 1
        try:
            self.client.submit(TransferTask(task_id, kind, gpu, cpu or [], keys or [], tags or [], remote, first_block,
                                            tail_tokens))
        except CacheTransferError as e:
            self.lose(str(e))
            return None
        return task_id

    def run(self, kind: TransferKind, gpu: list[int], cpu: list[int] | None = None,
            keys: list[str] | None = None, tags: list[int] | None = None) -> TransferAck:  # fmt: skip
        """Submit and wait; a dead or stuck CTM fails every block of the task (and is marked lost)."""
        task_id = self.submit(kind, gpu, cpu, keys, tags)
        if task_id is not None:
            assert self.client is not None
            try:
                ack = self.client.wait(task_id, timeout=self.timeout_s)
            except CacheTransferError as e:
                self.lose(str(e))
            else:
                if ack.failed and kind in (TransferKind.SWAP2CPU, TransferKind.SWAP2GPU):
                    logger.warning("%s failed for %d blocks: %s", kind.value, len(ack.failed), ack.error)
                return ack
        return TransferAck(-1, kind, ok=False, failed=list(range(len(gpu))), error=self.lost or self.failed)

    def acks(self, wait_for: list[int] | None = None) -> list[TransferAck]:
        """Acks that arrived (never blocks), plus those of `wait_for` (blocks up to timeout_s each)."""
        if not self.usable:
            return []
        assert self.client is not None
        try:
            got = self.client.poll()
            seen = {a.task_id for a in got}
            for task_id in wait_for or []:
                if task_id not in seen:
                    got.append(self.client.wait(task_id, timeout=self.timeout_s))
        except CacheTransferError as e:
            self.lose(str(e))
            return []
        return got

    def wait_any(self, timeout_s: float) -> None:
        """Block until some ack arrived or timeout_s passed (returns at once without a usable CTM, or
        with a client that cannot wait: a test's fake)."""
        wait_any = getattr(self.client, "wait_any", None)
        if not self.usable or wait_any is None:
            return
        try:
            wait_any(timeout_s)
        except CacheTransferError as e:
            self.lose(str(e))

    def lose(self, reason: str) -> None:
        """The CTM is dead or stuck: its pending work is abandoned and the tiers skip it until tick()
        has replaced it."""
        if self.lost is None:
            self.transfers_lost += 1
            logger.warning("cache transfer manager lost (%s); CPU tier and storage are skipped until it is replaced",
                           reason)
        self.lost = reason
        for user in self._users:
            user.transfer_lost()

    # -- supervision --------------------------------------------------------------------------------

    def tick(self) -> None:
        """Once per step: notice a dead CTM, replace a lost one, adopt a replacement that is ready."""
        if self.client is not None and self.lost is None and not self.client.is_alive():
            self.lose(f"the cache transfer manager (pid {self.client.pid}) exited")
        self.stop_lost()
        self._adopt()

    def stop_lost(self) -> None:
        """Kill a lost CTM now (tick() does at the next step) and launch its replacement: once it is gone,
        nothing it was asked to do can still write a GPU block, so a load it owed can end as failed."""
        if self.lost is not None and self.client is not None:
            self._replace(self.lost)

    def _replace(self, reason: str) -> None:
        old, self.client = self.client, None
        assert old is not None
        logger.warning("cache transfer manager (pid %s) is replaced after: %s", old.pid, reason)
        old.kill()  # a stuck one must be gone before its blocks are reused
        self.replacements += 1
        if self.config is None:
            self._give_up("no config to start another one with")
            return
        self.config = dataclasses.replace(self.config, storage_must_answer=False)
        self._starting, self._starting_since = CacheTransferClient(), time.monotonic()
        self._starting.launch(self.config)

    def _adopt(self) -> None:
        new = self._starting
        if new is None:
            return
        try:
            if not new.ready():
                if time.monotonic() - self._starting_since < START_TIMEOUT_S:
                    return
                new.kill()
                raise CacheTransferError(f"it did not come up within {START_TIMEOUT_S:g} s")
        except CacheTransferError as e:  # serving on without tiers beats failing every request
            self._starting = None
            self._give_up(f"replacement failed: {e}")
            return
        self.client, self._starting, self.lost = new, None, None
        for user in self._users:
            user.transfer_replaced(True)

    def _give_up(self, why: str) -> None:
        logger.error("cache transfer manager could not be replaced (%s); serving without CPU and storage tiers", why)
        self.failed, self.lost = why, None
        for user in self._users:
            user.transfer_replaced(False)

    def stop(self) -> None:
        if self._starting is not None:
            self._starting.kill()
            self._starting = None
        if self.client is not None:
            try:
                self.client.shutdown()
            except Exception:
                logger.exception("cache transfer manager shutdown")
            self.client = None
