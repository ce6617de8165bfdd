"""Block tables of requests over a tiered prefix cache: GPU pool → CPU tier → storage tier.

    request block_table:  [ g3 | g7 | g1 | g8 ]        g = GPU block id
                            hit  hit  load new          (hit: GPU prefix hit, load: swapped in or
                                                          loaded from storage, new: computed now)

Transfers run through the CacheTransferManager and are waited for before the blocks they touch
are used: eviction swap-outs before anything is written into the evicted block, swap-ins and
storage loads before the step that reads them. Write-through puts pin their block (a reference)
until acknowledged, so a block is never rewritten while a transfer reads it.

Every GPU block carries a routing_tag: the provenance of its R3 rows. A block computed here gets a
fresh tag; a block swapped in keeps the tag its rows were swapped out with; a block loaded from
storage gets a fresh tag that the CacheTransferManager stamps on the loaded rows.

Faults cost recomputation, never a request: a storage lookup runs off the engine loop with a
deadline (storage_lookup.py; the request waits for it, nobody else does); a transfer that fails or
misses `transfer_timeout_s` (the CTM died or is stuck) counts as failed for every block, and the
manager marks the CTM lost (`transfer_lost`): the tiers behind it are skipped until the engine has
replaced the CTM and called `reset_transfer` with the new one (its CPU tier starts empty).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from fastdeploy_r3.cache_manager.block_hash import block_hash as chain_hash
from fastdeploy_r3.cache_manager.block_pool import BlockPool, KVBlock
from fastdeploy_r3.cache_manager.cache_transfer_manager import CacheTransferError
from fastdeploy_r3.cache_manager.storage_lookup import StorageLookup
from fastdeploy_r3.cache_manager.transfer import TransferAck, TransferKind, TransferTask

logger = logging.getLogger(__name__)


class Request(Protocol):
    """What the prefix cache reads of a request (engine.request.Request): its id and token cursors."""

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...


class BlockStorage(Protocol):
    """What the prefix cache asks the storage tier (KVStorageBackend): which block keys it holds."""

    def exists(self, keys: list[str]) -> list[bool]: ...


class TransferClient(Protocol):
    """What the prefix cache asks the CacheTransferManager (CacheTransferClient): run tasks, report acks."""

    def submit(self, task: TransferTask) -> None: ...

    def poll(self) -> list[TransferAck]: ...

    def wait(self, task_id: int, timeout: float | None = 60) -> TransferAck: ...


@dataclass
class PrefixHit:
    """Leading full blocks of a request found in some tier, in order: GPU, then CPU, then storage."""

    gpu_blocks: list[KVBlock] = field(default_factory=list)
    cpu_blocks: list[KVBlock] = field(default_factory=list)
    storage_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.gpu_blocks) + len(self.cpu_blocks) + len(self.storage_hashes)


@dataclass
class CacheCounters:
    gpu_hit_blocks: int = 0
    swap_in_blocks: int = 0
    swap_out_blocks: int = 0
    storage_load_blocks: int = 0
    storage_load_failed_blocks: int = 0
    storage_put_blocks: int = 0
    evicted_blocks: int = 0
    dropped_blocks: int = 0  # evicted with nowhere to go
    transfers_lost: int = 0  # times the CTM was found dead or stuck


class PrefixCacheManager:
    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        root_hash: bytes,
        num_cpu_blocks: int = 0,
        storage: BlockStorage | None = None,
        transfer: TransferClient | None = None,
        lookup: StorageLookup | None = None,  # storage lookups off the loop (else storage.exists inline)
        transfer_timeout_s: float = 60.0,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = root_hash
        self.gpu = BlockPool(num_gpu_blocks)
        self.cpu = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 and enable_prefix_caching else None
        self.storage = storage if enable_prefix_caching else None
        self.transfer = transfer
        self.lookup = lookup if enable_prefix_caching else None
        self.transfer_timeout_s = transfer_timeout_s
        self.transfer_lost: str | None = None  # why the CTM is unusable, until reset_transfer()
        self.num_cpu_blocks = num_cpu_blocks
        self._storage_found: dict[str, list[bool]] = {}  # request -> its lookup's answer, per full block
        # Hashes this engine's puts stored, newest last: a lookup runs off the loop and may answer from
        # before a put landed, so a block found here counts as stored too (a load that then misses, the
        # block expired or evicted since, is recomputed like any failed load).
        self._recently_stored: OrderedDict[bytes, None] = OrderedDict()
        self._recently_stored_cap = max(4096, 4 * num_gpu_blocks)
        self.counters = CacheCounters()
        self._blocks: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # hashes of the request's full blocks so far
        self._num_cached: dict[str, int] = {}  # leading blocks of the request registered in the pool
        self._pinned: dict[int, list[KVBlock]] = {}  # write-through task id -> blocks it reads
        # requests whose KV predates the current root (in flight across a weight update): their blocks
        # mix two weight versions, so none of them is ever cached or stored
        self._stale: set[str] = set()
        self._next_tag = 1
        self._next_task_id = 1

    # -- queries ------------------------------------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, [])]

    def block_tags(self, request_id: str) -> list[int]:
        return [b.routing_tag for b in self._blocks.get(request_id, [])]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _request_hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(req.request_id, [])
        tokens = req.all_token_ids
        parent = hashes[-1] if hashes else self.root_hash
        for i in range(len(hashes), num_blocks):
            parent = chain_hash(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(parent)
        return hashes[:num_blocks]

    def _block_tokens(self, tokens: list[int], i: int) -> tuple[int, ...]:
        """Token ids of full block i of a request's tokens: what a cached block must hold to be a hit."""
        return tuple(tokens[i * self.block_size : (i + 1) * self.block_size])

    def find_cached_prefix(self, req: Request) -> PrefixHit | None:
        """The longest run of leading full blocks found in some tier; None while the request's storage
        lookup is still running (the first call starts it; try again next step).

        Capped so that at least the last token is computed (its logits sample the next token).
        """
        hit = PrefixHit()
        if not self.enable_prefix_caching:
            return hit
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self._request_hashes(req, max_blocks)
        tokens = req.all_token_ids
        i = 0
        while i < len(hashes) and (b := self.gpu.lookup(hashes[i], self._block_tokens(tokens, i))) is not None:
            hit.gpu_blocks.append(b)
            i += 1
        if self.transfer_lost is not None:
            return hit  # the CPU tier and storage loads need the CTM
        while (self.cpu is not None and i < len(hashes)
               and (b := self.cpu.lookup(hashes[i], self._block_tokens(tokens, i))) is not None):
            hit.cpu_blocks.append(b)
            i += 1
        # Stored blobs carry no token ids: the storage tier trusts its 128-bit hash (DESIGN.md §4).
        if i < len(hashes) and (self.lookup is not None or self.storage is not None):
            found = self._found_in_storage(req.request_id, hashes)
            if found is None:
                return None
            # a degraded store answers "missing" without asking: do not send loads to it either
            recent = self._recently_stored if self.lookup is None or self.lookup.health.degraded is None else {}
            for h, present in zip(hashes[i:], found[i:]):
                if not present and h not in recent:
                    break
                hit.storage_hashes.append(h)
        return hit

    def _found_in_storage(self, request_id: str, hashes: list[bytes]) -> list[bool] | None:
        """Per full block of the request, whether storage holds it; None while the lookup runs."""
        found = self._storage_found.get(request_id)
        if found is not None and len(found) >= len(hashes):
            return found
        keys = [h.hex() for h in hashes]
        if self.lookup is not None:
            if not self.lookup.has(request_id):
                self.lookup.start(request_id, keys)
            found = self.lookup.answer(request_id)
            if found is None:
                return None
        elif self.storage is not None:
            found = self.storage.exists(keys)
        else:
            found = [False] * len(keys)
        self._storage_found[request_id] = found
        return found

    def can_admit(self, hit: PrefixHit, num_new_tokens: int) -> bool:
        hit_tokens = hit.num_blocks * self.block_size
        need = self.blocks_needed(hit_tokens + num_new_tokens) - len(hit.gpu_blocks)
        revived = sum(1 for b in hit.gpu_blocks if b.ref_cnt == 0)  # leave the free list when touched
        return need <= self.gpu.num_free_blocks - revived

    def can_append(self, req: Request, num_new_tokens: int) -> bool:
        have = len(self._blocks.get(req.request_id, []))
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - have
        return need <= self.gpu.num_free_blocks

    # -- mutations ----------------------------------------------------------------------------------

    def admit(self, req: Request, hit: PrefixHit, num_new_tokens: int) -> int:
        """Give a waiting request its block table; returns its num_computed_tokens (the usable hit).

        A storage block that fails to load truncates the hit there; the blocks from it on are
        computed instead (they were allocated anyway), so the caller schedules from the returned
        cursor.
        """
        assert req.request_id not in self._blocks, f"{req.request_id} admitted twice"
        bs = self.block_size
        self.gpu.touch(hit.gpu_blocks)
        if self.cpu is not None:
            self.cpu.touch(hit.cpu_blocks)  # pin the sources: allocating may evict CPU blocks
        n_load = len(hit.cpu_blocks) + len(hit.storage_hashes)
        hit_tokens = hit.num_blocks * bs
        n_new = self.blocks_needed(hit_tokens + num_new_tokens) - hit.num_blocks
        fresh = self._allocate(n_load + n_new)
        swap_dst, load_dst, compute = (
            fresh[: len(hit.cpu_blocks)],
            fresh[len(hit.cpu_blocks) : n_load],
            fresh[n_load:],
        )
        blocks = list(hit.gpu_blocks)
        usable = len(hit.gpu_blocks)
        self.counters.gpu_hit_blocks += len(hit.gpu_blocks)
        loaded_ok = True
        if swap_dst:
            ack = self._run(
                TransferKind.SWAP2GPU,
                gpu=[b.block_id for b in swap_dst],
                cpu=[b.block_id for b in hit.cpu_blocks],
            )
            for j, (dst, src) in enumerate(zip(swap_dst, hit.cpu_blocks)):
                if j in ack.failed or not loaded_ok:
                    loaded_ok = False
                    continue
                assert src.block_hash is not None and src.token_ids is not None  # found by lookup
                dst.routing_tag = src.routing_tag
                self.gpu.cache(dst, src.block_hash, src.token_ids)
                usable += 1
                self.counters.swap_in_blocks += 1
            assert self.cpu is not None
            self.cpu.free(hit.cpu_blocks)
        if load_dst and loaded_ok:
            tags = [self._new_tag() for _ in load_dst]
            ack = self._run(
                TransferKind.STORAGE2GPU,
                gpu=[b.block_id for b in load_dst],
                keys=[h.hex() for h in hit.storage_hashes],
                tags=tags,
            )
            first, tokens = len(hit.gpu_blocks) + len(hit.cpu_blocks), req.all_token_ids  # first: its block index
            for j, (dst, h, tag) in enumerate(zip(load_dst, hit.storage_hashes, tags)):
                if j in ack.failed or not loaded_ok:
                    loaded_ok = False
                    continue
                dst.routing_tag = tag
                self.gpu.cache(dst, h, self._block_tokens(tokens, first + j))
                usable += 1
                self.counters.storage_load_blocks += 1  # only blocks the request uses count
            self.counters.storage_load_failed_blocks += len(ack.failed)
        blocks.extend(swap_dst)
        blocks.extend(load_dst)
        blocks.extend(compute)
        for b in blocks[usable:]:
            # computed here: blocks after a failed load lose whatever a partial load left behind
            self.gpu.uncache(b)
            b.routing_tag = self._new_tag()
        self._blocks[req.request_id] = blocks
        self._num_cached[req.request_id] = usable
        return usable * bs

    def append_slots(self, req: Request, num_new_tokens: int) -> None:
        """Grow a running request's block table to hold num_computed_tokens + num_new_tokens."""
        blocks = self._blocks.setdefault(req.request_id, [])
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(blocks)
        if need > 0:
            new = self._allocate(need)
            for b in new:
                b.routing_tag = self._new_tag()
            blocks.extend(new)

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the request's newly full, computed blocks; write them through to storage."""
        if not self.enable_prefix_caching or req.request_id in self._stale:
            return
        blocks = self._blocks.get(req.request_id)
        if not blocks:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(blocks))
        start = self._num_cached.get(req.request_id, 0)
        if num_full <= start:
            return
        hashes = self._request_hashes(req, num_full)
        tokens = req.all_token_ids
        new_cached = []
        for i in range(start, num_full):
            if self.gpu.cache(blocks[i], hashes[i], self._block_tokens(tokens, i)):
                new_cached.append((blocks[i], hashes[i]))
        self._num_cached[req.request_id] = num_full
        writable = self.storage is not None or self.lookup is not None
        if writable and self.transfer is not None and self.transfer_lost is None and new_cached:
            put_blocks = [b for b, _ in new_cached]
            self.gpu.touch(put_blocks)  # pinned until the put is acknowledged
            try:
                task_id = self._submit(
                    TransferKind.GPU2STORAGE,
                    gpu=[b.block_id for b in put_blocks],
                    keys=[h.hex() for _, h in new_cached],
                    tags=[b.routing_tag for b in put_blocks],  # the CTM refuses rows not written under this tag
                )
            except CacheTransferError as e:
                self.gpu.free(put_blocks)
                self.lose_transfer(str(e))
                return
            self._pinned[task_id] = put_blocks

    def forget_cached(self, request_id: str) -> int:
        """Drop the prefix-cache entries of a request's blocks (their R3 rows failed a check), so later
        requests recompute them instead of failing on the same rows. Current owners keep the blocks."""
        n = 0
        for b in self._blocks.get(request_id, []):
            if b.block_hash is not None:
                self.gpu.uncache(b)
                n += 1
        return n

    def flush(self) -> int:
        """Forget every cached prefix in the GPU pool and the CPU tier (SGLang's /flush_cache); blocks in
        use keep their owners. The storage tier is left alone: its keys are rooted at the weight version,
        so nothing in it can be served to another version. Returns the number of entries dropped."""
        n = self.gpu.uncache_all()
        if self.cpu is not None:
            n += self.cpu.uncache_all()
        return n

    def reset_root(self, root_hash: bytes) -> None:
        """A new weight version: every hash from now on chains from root_hash, the caches are flushed,
        and requests already holding blocks (their KV computed by the old weights) never cache theirs.

        A request preempted later recomputes from scratch under the new weights, so it leaves the
        stale set when it frees its blocks."""
        self.root_hash = root_hash
        self.flush()
        self._stale.update(self._blocks)
        self._hashes.clear()

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first; cached ones stay cached."""
        self._stale.discard(req.request_id)
        blocks = self._blocks.pop(req.request_id, [])
        self.gpu.free(list(reversed(blocks)))
        self._num_cached.pop(req.request_id, None)
        self._hashes.pop(req.request_id, None)
        self._storage_found.pop(req.request_id, None)
        if self.lookup is not None:
            self.lookup.forget(req.request_id)

    def poll_transfers(self, block: bool = False) -> None:
        """Unpin blocks whose write-through finished (all of them when block=True)."""
        if self.transfer is None or not self._pinned or self.transfer_lost is not None:
            return
        try:
            acks = self.transfer.poll()
            for ack in acks:
                self._finish_put(ack)
            if block:
                for task_id in list(self._pinned):
                    self._finish_put(self.transfer.wait(task_id, timeout=self.transfer_timeout_s))
        except CacheTransferError as e:
            self.lose_transfer(str(e))

    def lose_transfer(self, reason: str) -> None:
        """The CTM is dead or stuck: its pending puts are abandoned (blocks unpinned) and every tier
        behind it is skipped until reset_transfer()."""
        if self.transfer_lost is None:
            self.counters.transfers_lost += 1
            logger.warning("cache transfer manager lost (%s); CPU tier and storage are skipped until it is replaced",
                           reason)
        self.transfer_lost = reason
        for blocks in self._pinned.values():
            self.gpu.free(blocks)
        self._pinned.clear()

    def reset_transfer(self, transfer: object | None) -> None:
        """Continue with a new CTM (None: without one). Its CPU tier is empty, so ours forgets every block."""
        self.transfer = transfer
        self.transfer_lost = None
        if self.cpu is not None:
            self.cpu = BlockPool(self.num_cpu_blocks) if transfer is not None else None
        if transfer is None:
            self.storage = self.lookup = None

    def has_pending_lookups(self) -> bool:
        return self.lookup is not None and self.lookup.pending()

    # -- internals ----------------------------------------------------------------------------------

    def _finish_put(self, ack: TransferAck) -> None:
        blocks = self._pinned.pop(ack.task_id, None)
        if blocks is None:
            return
        self.counters.storage_put_blocks += len(blocks) - len(ack.failed)
        failed = set(ack.failed)
        for i, b in enumerate(blocks):
            if i not in failed and b.block_hash is not None:
                self._recently_stored[b.block_hash] = None  # a lookup answered before this put missed it
                self._recently_stored.move_to_end(b.block_hash)
        while len(self._recently_stored) > self._recently_stored_cap:
            self._recently_stored.popitem(last=False)
        if not ack.ok:
            logger.warning("write-through of %d blocks failed: %s", len(ack.failed), ack.error)
        self.gpu.free(blocks)

    def _new_tag(self) -> int:
        tag, self._next_tag = self._next_tag, self._next_tag + 1
        return tag

    def _allocate(self, n: int) -> list[KVBlock]:
        blocks = self.gpu.allocate(n)
        self._swap_out_evicted()
        return blocks

    def _swap_out_evicted(self) -> None:
        """Copy just-evicted cached GPU blocks into the CPU tier before anything rewrites them."""
        evicted = self.gpu.pop_evicted()
        self.counters.evicted_blocks += len(evicted)
        if not evicted:
            return
        if self.cpu is None or self.transfer is None or self.transfer_lost is not None:
            self.counters.dropped_blocks += len(evicted)
            return
        pairs: list[tuple[int, KVBlock]] = []
        for ev in evicted:
            existing = self.cpu.lookup(ev.block_hash, ev.token_ids)
            if existing is not None:  # already in the CPU tier: refresh its LRU position
                self.cpu.touch([existing])
                self.cpu.free([existing])
                continue
            if not self.cpu.can_allocate(1):
                self.counters.dropped_blocks += 1
                continue
            (cpu_block,) = self.cpu.allocate(1)
            self.cpu.pop_evicted()  # the CPU tier is last in line: its evictions are dropped
            cpu_block.routing_tag = ev.routing_tag
            self.cpu.cache(cpu_block, ev.block_hash, ev.token_ids)
            pairs.append((ev.block_id, cpu_block))
        if not pairs:
            return
        ack = self._run(TransferKind.SWAP2CPU, gpu=[g for g, _ in pairs], cpu=[c.block_id for _, c in pairs])
        for j, (_, cpu_block) in enumerate(pairs):
            if j in ack.failed:
                self.cpu.uncache(cpu_block)
        self.cpu.free([c for _, c in pairs])
        self.counters.swap_out_blocks += len(pairs) - len(ack.failed)

    def _submit(
        self,
        kind: TransferKind,
        gpu: list[int],
        cpu: list[int] | None = None,
        keys: list[str] | None = None,
        tags: list[int] | None = None,
    ) -> int:
        assert self.transfer is not None, f"{kind} needs the cache transfer manager"
        task_id, self._next_task_id = self._next_task_id, self._next_task_id + 1
        task = TransferTask(task_id, kind, gpu, cpu or [], keys or [], tags or [])
        self.transfer.submit(task)
        return task_id

    def _run(self, kind: TransferKind, **kw: list) -> TransferAck:
        """Submit and wait; a dead or stuck CTM fails every block of the task (and is marked lost)."""
        n = len(kw["gpu"])
        if self.transfer_lost is not None:
            return TransferAck(-1, kind, ok=False, failed=list(range(n)), error=self.transfer_lost)
        try:
            task_id = self._submit(kind, **kw)
            ack = self.transfer.wait(task_id, timeout=self.transfer_timeout_s)
        except CacheTransferError as e:
            self.lose_transfer(str(e))
            return TransferAck(-1, kind, ok=False, failed=list(range(n)), error=str(e))
        if ack.failed and kind in (TransferKind.SWAP2CPU, TransferKind.SWAP2GPU):
            logger.warning("%s failed for %d blocks: %s", kind.value, len(ack.failed), ack.error)
        return ack

    # -- tests --------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        self.gpu.check_integrity()
        if self.cpu is not None:
            self.cpu.check_integrity()
        owners: dict[int, int] = {}
        for blocks in self._blocks.values():
            for b in blocks:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
        for blocks in self._pinned.values():
            for b in blocks:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
        for b in self.gpu.blocks:
            owned = owners.get(b.block_id, 0)
            assert b.ref_cnt == owned, f"{b} has ref_cnt {b.ref_cnt} but {owned} owners"
