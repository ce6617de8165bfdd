"""The storage tier: computed blocks are written through to a shared store (file, Redis, Mooncake)
under their hash, and a prefix found there is loaded into fresh GPU blocks.

    cache_computed_blocks ──save(blocks)──► GPU2STORAGE   blocks pinned until poll() returns the id
    find_cached_prefix ─────lookup()──────► StorageLookup (off the loop, deadline; storage_lookup.py)
    admit ──────────────────start_load()──► STORAGE2GPU   rows stamped with the manager's fresh tags;
    finish_load(block=False) → None until its ack       submitted, not waited for: the loop runs on

A request a prefill server handed over (PD, expect_remote) finds its prompt blocks here too: the
room's blocks count as present, its partial last block with them (BlockKey.partial), and their load is
a PD2GPU task, P writing them straight into the blocks (cache_manager/pd_receive.py);
everything after start_load is a storage load's. On the prefill server, save_tail stores that partial
block at the request's end (GPU2STORAGE with tail_tokens), for its outbox to send or, through a shared
store, for the decode server's lookup to find under its key like any other.

A load's ack is told from a put's by its task id (both come back through the same acks()). A load
ends as failed (its blocks are computed) when the CTM is lost, but only once that CTM can no longer
write: it exited, or the supervisor killed it (tick(), or stop_lost() for a caller that must block); a
load without an ack after the supervisor's timeout_s marks the CTM stuck (lost) the same way.

Stored blobs carry no token ids: this tier trusts the 128-bit chain hash (block_hash.py), and keys
are rooted at the weight version, so a flush leaves the store alone. The CacheTransferManager
writes and reads the blobs; this side only asks which keys exist, through the lookup, which owns
the engine's lookup-only store connection and closes it in close().
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastdeploy_r3.cache_manager.kv_connector import (
    BlockKey,
    CacheCounters,
    CachedBlock,
    KVConnector,
    LoadResult,
    TierHit,
)
from fastdeploy_r3.cache_manager.storage_lookup import StorageLookup
from fastdeploy_r3.cache_manager.transfer import RemoteBlocks, TransferAck, TransferKind
from fastdeploy_r3.cache_manager.transfer_supervisor import TransferClient, TransferSupervisor

logger = logging.getLogger(__name__)


class StorageTier(KVConnector):
    name = "storage"

    def __init__(self, lookup: StorageLookup, transfers: TransferSupervisor,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.lookups = lookup
        self.transfers = transfers
        self.available = True  # False once the CTM is gone for good: nothing can load or store
        self.counters = CacheCounters()
        self._clock = clock
        self._saves: dict[int, list[str]] = {}  # task id of a put in flight -> its keys
        self._saved: list[int] = []  # puts acknowledged since the last poll()
        self._abandoned: list[int] = []  # puts of a lost CTM: their blocks can be unpinned
        self._loads: dict[int, _Load] = {}  # task id of a load not finished yet -> its state
        self._remote: dict[str, RemoteBlocks] = {}  # request id -> the room P writes its blocks from
        transfers.subscribe(self)

    def expect_remote(self, request_id: str, remote: RemoteBlocks) -> bool:
        self._remote[request_id] = remote
        return True

    def lookup(self, request_id: str, keys: list[BlockKey], start: int) -> TierHit | None:
        hit = TierHit(self)
        if not self.available or not self.transfers.usable:
            return hit
        remote = self._remote.get(request_id)
        if remote is not None:  # block i of the request is block i of P's prompt: the same chain hash
            hit.keys = keys[start:min(len(keys), len(remote.block_digests))]
            if hit.keys and hit.keys[-1].partial and len(hit.keys[-1].token_ids) != remote.tail_tokens:
                hit.keys.pop()  # P's last blob is a full block, or a partial one of other tokens
            hit.sources = [_FromPeer(remote, start)]
            return hit
        if start >= len(keys):
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
        load = _Load(None, n, list(fresh_tags), self._clock(), self.transfers.client)
        peer = hit.sources[0] if hit.sources and isinstance(hit.sources[0], _FromPeer) else None
        if n and peer is not None:
            load.task_id = self.transfers.submit(TransferKind.PD2GPU, gpu=list(gpu_block_ids), tags=list(fresh_tags),
                                                 remote=peer.remote, first_block=peer.first)  # fmt: skip
        elif n:
            load.task_id = self.transfers.submit(TransferKind.STORAGE2GPU, gpu=list(gpu_block_ids),
                                                 keys=_keys(hit.keys[:n]), tags=list(fresh_tags))  # fmt: skip
        if load.task_id is None:
            load.ack = self._failed_ack(n)  # nothing to load, or no CTM to load with
        else:
            self._loads[load.task_id] = load
        hit.pending = load

    def finish_load(self, hit: TierHit, block: bool = True) -> LoadResult | None:
        load: _Load = hit.pending
        if load.ack is None and not load.lost:
            self._collect(wait_for=[load.task_id] if block else None)  # type: ignore[list-item]
        if load.ack is None and not load.lost and self._clock() - load.started > self.transfers.timeout_s:
            self.transfers.lose(f"no ack for storage load task {load.task_id} within {self.transfers.timeout_s:g} s")
        if load.ack is None and (load.lost or block):
            if block:
                if not load.lost:  # acks() answered without it: treat the CTM as stuck
                    self.transfers.lose(f"storage load task {load.task_id} got no ack")
                self.transfers.stop_lost()  # the caller must have an answer now: no CTM may write later
            if load.client is not self.transfers.client or load.client is None or not load.client.is_alive():
                load.ack = self._failed_ack(load.n)  # the CTM that owed the bytes can write no more
        if load.ack is None:
            return None
        hit.pending = None
        if load.task_id is not None:
            self._loads.pop(load.task_id, None)
        tags = []
        for j in range(load.n):
            if j in load.ack.failed:
                break
            tags.append(load.fresh_tags[j])  # the CTM stamped the loaded rows with it
        self.counters.storage_load_blocks += len(tags)  # only blocks the request uses count
        self.counters.storage_load_failed_blocks += len(load.ack.failed)
        return LoadResult(tags)

    def loads_in_flight(self) -> bool:
        return any(load.ack is None for load in self._loads.values())

    def wait_for_loads(self, timeout_s: float) -> None:
        if any(load.ack is None and not load.lost for load in self._loads.values()):
            self.transfers.wait_any(timeout_s)

    def save(self, blocks: list[CachedBlock], tail_tokens: int = 0) -> int | None:
        """tail_tokens > 0: the last block is a partial one holding that many tokens (save_tail)."""
        if not self.available:
            return None
        keys = [b.block_hash.hex() for b in blocks]  # as _keys()
        task_id = self.transfers.submit(TransferKind.GPU2STORAGE, gpu=[b.block_id for b in blocks], keys=keys,
                                        tags=[b.routing_tag for b in blocks],  # the CTM refuses rows not under it
                                        tail_tokens=tail_tokens)  # fmt: skip
        if task_id is not None:
            self._saves[task_id] = keys
        return task_id

    def save_tail(self, block: CachedBlock) -> int | None:
        return self.save([block], tail_tokens=len(block.token_ids))

    def poll(self, block: bool = False) -> list[int]:
        if self._saves or self.loads_in_flight():
            self._collect(wait_for=list(self._saves) if block else None)
        done = self._saved + self._abandoned  # abandoned: the CTM was lost, maybe while we waited
        self._saved, self._abandoned = [], []
        return done

    def pending(self) -> bool:
        return self.lookups.pending()

    def on_free(self, request_id: str) -> None:
        self.lookups.forget(request_id)
        self._remote.pop(request_id, None)  # what it loaded is in the GPU pool now; a rerun computes the rest

    def transfer_lost(self) -> None:
        self._abandoned += list(self._saves)
        self._saves.clear()
        for load in self._loads.values():
            load.lost = True  # failed once its CTM is gone (finish_load), unless its ack came first

    def transfer_replaced(self, available: bool) -> None:
        self.available = available

    def close(self) -> None:
        self.lookups.close()

    def _collect(self, wait_for: list[int] | None = None) -> None:
        """Take the acks that arrived (and wait for those of `wait_for`), each to its put or its load."""
        for ack in self.transfers.acks(wait_for=wait_for):
            load = self._loads.get(ack.task_id)
            if load is not None:
                load.ack = ack
            elif self._finish_save(ack):
                self._saved.append(ack.task_id)
            else:
                logger.warning("ack of unknown transfer task %d (%s) dropped", ack.task_id, ack.kind.value)

    def _failed_ack(self, n: int) -> TransferAck:
        why = self.transfers.lost or self.transfers.failed or "no cache transfer manager"
        return TransferAck(-1, TransferKind.STORAGE2GPU, ok=not n, failed=list(range(n)), error=None if not n else why)

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


@dataclass(frozen=True)
class _FromPeer:
    """A hit on a prefill server's room: its keys are the room's blocks from `first` on."""

    remote: RemoteBlocks
    first: int


@dataclass
class _Load:
    """One started load: its task (None: nothing was submitted), the tags its rows get, and the CTM
    that owes its ack (a lost one must be gone before the load may end as failed)."""

    task_id: int | None
    n: int
    fresh_tags: list[int]
    started: float
    client: TransferClient | None
    ack: TransferAck | None = None
    lost: bool = False


def _keys(keys: list[BlockKey]) -> list[str]:
    return [k.block_hash.hex() for k in keys]  # the store's key of a block: its chain hash in hex
