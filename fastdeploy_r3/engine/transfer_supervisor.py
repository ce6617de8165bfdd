"""The engine's cache transfer manager (CTM) over its whole life: started with the engine, replaced
when it dies or gets stuck, and never waited for by the engine loop once the engine is up.

    running ──dies, or an ack misses transfer_timeout_s──► lost: the prefix cache skips its tiers,
       ▲                                                   │     and what it held becomes misses
       │                                                   ▼
       └──────── ready ◄─── starting ◄─── killed, a new one launched (a store that is down
                               │                 does not keep it from starting: it starts degraded)
                               └── setup failed, or not up within 300 s ──► none: GPU cache only,
                                                                           /health says why
"""

from __future__ import annotations

import dataclasses
import logging
import time

from fastdeploy_r3.cache_manager.cache_transfer_client import CacheTransferClient
from fastdeploy_r3.cache_manager.cache_transfer_manager import CacheTransferError
from fastdeploy_r3.cache_manager.prefix_cache_manager import PrefixCacheManager
from fastdeploy_r3.cache_manager.transfer import CacheTransferConfig

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # a replacement that is not up by then: serve without tiers


class TransferSupervisor:
    def __init__(self, config: CacheTransferConfig) -> None:
        self.config = config
        self.client: CacheTransferClient | None = None  # the running CTM
        self.replacements = 0
        self.failed: str | None = None  # why the engine serves without a CTM, once it gave up
        self._starting: CacheTransferClient | None = None
        self._starting_since = 0.0

    @property
    def store_counters(self) -> dict[str, int]:
        return dict(self.client.stats.store_counters) if self.client is not None else {}

    def start(self) -> CacheTransferClient:
        """The first CTM, at engine start (blocking: a store that is down fails the start clearly)."""
        self.client = CacheTransferClient()
        self.client.start(self.config)
        return self.client

    def tick(self, kv: PrefixCacheManager) -> None:
        """Once per step: notice a dead CTM, replace a lost one, adopt a replacement that is ready."""
        if self.client is not None and not self.client.is_alive() and kv.transfer_lost is None:
            kv.lose_transfer(f"the cache transfer manager (pid {self.client.pid}) exited")
        if kv.transfer_lost is not None and self.client is not None:
            self._replace(kv.transfer_lost)
        self._adopt(kv)

    def _replace(self, reason: str) -> None:
        old, self.client = self.client, None
        assert old is not None
        logger.warning("cache transfer manager (pid %s) is replaced after: %s", old.pid, reason)
        old.kill()  # a stuck one must be gone before its blocks are reused
        self.replacements += 1
        self.config = dataclasses.replace(self.config, storage_must_answer=False)
        self._starting, self._starting_since = CacheTransferClient(), time.monotonic()
        self._starting.launch(self.config)

    def _adopt(self, kv: PrefixCacheManager) -> None:
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
            logger.error("cache transfer manager could not be replaced (%s); serving without CPU and storage tiers", e)
            self._starting, self.failed = None, f"replacement failed: {e}"
            kv.reset_transfer(None)
            return
        self.client, self._starting = new, None
        kv.reset_transfer(new)

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
