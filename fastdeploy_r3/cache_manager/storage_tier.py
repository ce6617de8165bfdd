"""The storage tier: computed blocks are written through to a shared store (file, Redis, Mooncake)
under their hash, and a prefix found there is loaded into fresh GPU blocks.

    cache_computed_blocks ──save(blocks)──► GPU2STORAGE   blocks pinned until poll() returns the id
    find_cached_prefix ─────lookup()──────► StorageLookup (off the loop, deadline; storage_lookup.py)
    admit ──────────────────start_load()──► STORAGE2GPU   rows stamped with the manager's fresh tags

Stored blobs carry no token ids: this tier trusts the 128-bit chain hash (block_hash.py), and keys
are rooted at the weight version, so a flush leaves the store alone. The CacheTransferManager
writes and reads the blobs; this side only asks which keys exist, through the lookup, which owns
the engine's lookup-only store connection and closes it in close().
"""

from __future__ import annotations

import logging

from fastdeploy_r3.cache_manager.kv_connector import (
    BlockKey,
    CacheCounters,
    CachedBlock,
    KVConnector,
    LoadResult,
    TierHit,
)
from fastdeploy_r3.cache_manager.storage_lookup import StorageLookup
from fastdeploy_r3.cache_manager.transfer import TransferAck, TransferKind
from fastdeploy_r3.cache_manager.transfer_supervisor import TransferSupervisor

logger = logging.getLogger(__name__)


class StorageTier(KVConnector):
    name = "storage"

    def __init__(self, lookup: StorageLookup, transfers: TransferSupervisor) -> None:
        self.lookups = lookup
        self.transfers = transfers
        self.available = True  # False once the CTM is gone for good: nothing can load or store
        self.counters = CacheCounters()
        self._saves: dict[int, list[str]] = {}  # task id of a put in flight -> its keys
        self._abandoned: list[int] = []  # puts of a lost CTM: their blocks can be unpinned
        transfers.subscribe(self)

    def lookup(self, request_id: str, keys: list[BlockKey], start: int) -> TierHit | None:
        hit = TierHit(self)
        if start >= len(keys) or not self.available or not self.transfers.usable:
            return hit
        found = self.lookups.found(request_id, _keys(keys))  # asked for all, so that the answer is kept whole
        if found is None:
            return None
        for key, present in zip(keys[start:], found[start:]):
            if not present:
                break
            hit.keys.append(key)
        return hit

    def start_load(self, hit: TierHit, gpu_block_ids: list[int], fresh_tags: list[int]) -> None:
        n = len(gpu_block_ids)
        ack = None
        if n:
            ack = self.transfers.run(TransferKind.STORAGE2GPU, gpu=list(gpu_block_ids),
                                     keys=_keys(hit.keys[:n]), tags=list(fresh_tags))  # fmt: skip
        hit.pending = (n, ack, list(fresh_tags))

    def finish_load(self, hit: TierHit, block: bool = True) -> LoadResult:
        n, ack, fresh_tags = hit.pending
        hit.pending = None
        tags = []
        for j in range(n):
            if j in ack.failed:
                break
            tags.append(fresh_tags[j])  # the CTM stamped the loaded rows with it
        self.counters.storage_load_blocks += len(tags)  # only blocks the request uses count
        if ack is not None:
            self.counters.storage_load_failed_blocks += len(ack.failed)
        return LoadResult(tags)

    def save(self, blocks: list[CachedBlock]) -> int | None:
        if not self.available:
            return None
        keys = [b.block_hash.hex() for b in blocks]  # as _keys()
        task_id = self.transfers.submit(TransferKind.GPU2STORAGE, gpu=[b.block_id for b in blocks], keys=keys,
                                        tags=[b.routing_tag for b in blocks])  # the CTM refuses rows not under it
        if task_id is not None:
            self._saves[task_id] = keys
        return task_id

    def poll(self, block: bool = False) -> list[int]:
        done, self._abandoned = self._abandoned, []
        if self._saves:
            for ack in self.transfers.acks(wait_for=list(self._saves) if block else None):
                if self._finish_save(ack):
                    done.append(ack.task_id)
        done += self._abandoned  # the CTM was lost while we waited
        self._abandoned = []
        return done

    def pending(self) -> bool:
        return self.lookups.pending()

    def on_free(self, request_id: str) -> None:
        self.lookups.forget(request_id)

    def transfer_lost(self) -> None:
        self._abandoned += list(self._saves)
        self._saves.clear()

    def transfer_replaced(self, available: bool) -> None:
        self.available = available

    def close(self) -> None:
        self.lookups.close()

    def _finish_save(self, ack: TransferAck) -> bool:
        keys = self._saves.pop(ack.task_id, None)
        if keys is None:
            return False
        failed = set(ack.failed)
        self.lookups.stored([k for i, k in enumerate(keys) if i not in failed])
        self.counters.storage_put_blocks += len(keys) - len(ack.failed)
        if not ack.ok:
            logger.warning("write-through of %d blocks failed: %s", len(ack.failed), ack.error)
        return True


def _keys(keys: list[BlockKey]) -> list[str]:
    return [k.block_hash.hex() for k in keys]  # the store's key of a block: its chain hash in hex
