"""The CPU tier: cached GPU blocks evicted from the GPU pool are swapped out here instead of being
dropped, and swapped back in on a hit (vLLM's swap space).

    GPU pool ──evicted(blocks)──► SWAP2CPU ──► CPU pool (a BlockPool of cached blocks only)
             ◄──start_load(hit)── SWAP2GPU ◄──┘  rows keep the tag they were swapped out with

The KV and rows live in the CacheTransferManager's memory; this side keeps the CPU pool's bookkeeping
(which hash, which tokens, which tag in which CPU block) and asks the CTM to copy. A lost CTM takes
the tier's contents with it: lookups find nothing until a replacement is adopted, which starts with
an empty tier (transfer_replaced).
"""

from __future__ import annotations

from fastdeploy_r3.cache_manager.block_pool import BlockPool
from fastdeploy_r3.cache_manager.kv_connector import (
    BlockKey,
    CacheCounters,
    CachedBlock,
    KVConnector,
    LoadResult,
    TierHit,
)
from fastdeploy_r3.cache_manager.transfer import TransferKind
from fastdeploy_r3.cache_manager.transfer_supervisor import TransferSupervisor


class CpuTier(KVConnector):
    name = "cpu"

    def __init__(self, num_cpu_blocks: int, transfers: TransferSupervisor) -> None:
        self.num_cpu_blocks = num_cpu_blocks
        self.pool: BlockPool | None = BlockPool(num_cpu_blocks)  # None: the CTM is gone for good
        self.transfers = transfers
        self.counters = CacheCounters()
        transfers.subscribe(self)

    def lookup(self, request_id: str, keys: list[BlockKey], start: int) -> TierHit | None:
        hit = TierHit(self)
        if self.pool is None or not self.transfers.usable:
            return hit
        for key in keys[start:]:
            block = self.pool.lookup(key.block_hash, key.token_ids)
            if block is None:
                break
            hit.keys.append(key)
            hit.sources.append(block)
        return hit

    def hold(self, hit: TierHit) -> None:
        assert self.pool is not None
        self.pool.touch(hit.sources)  # the swap-outs of the coming allocation may evict CPU blocks

    def start_load(self, hit: TierHit, gpu_block_ids: list[int], fresh_tags: list[int]) -> None:
        n = len(gpu_block_ids)
        cpu = [b.block_id for b in hit.sources[:n]]
        hit.pending = (n, self.transfers.run(TransferKind.SWAP2GPU, gpu=list(gpu_block_ids), cpu=cpu) if n else None)

    def finish_load(self, hit: TierHit, block: bool = True) -> LoadResult:
        n, ack = hit.pending
        hit.pending = None
        tags = []
        for j in range(n):
            if j in ack.failed:
                break
            tags.append(hit.sources[j].routing_tag)  # the rows came back with the tag they left with
        if self.pool is not None:
            self.pool.free(hit.sources)  # swapped in: the GPU pool caches them now, the CPU copy is LRU
        self.counters.swap_in_blocks += len(tags)
        return LoadResult(tags)

    def evicted(self, blocks: list[CachedBlock]) -> int:
        if self.pool is None or not self.transfers.usable:
            return 0
        pairs = []
        for ev in blocks:
            existing = self.pool.lookup(ev.block_hash, ev.token_ids)
            if existing is not None:  # already in the CPU tier: refresh its LRU position
                self.pool.touch([existing])
                self.pool.free([existing])
                continue
            if not self.pool.can_allocate(1):
                continue
            (cpu_block,) = self.pool.allocate(1)
            self.pool.pop_evicted()  # the CPU tier is last in line: its evictions are dropped
            cpu_block.routing_tag = ev.routing_tag
            self.pool.cache(cpu_block, ev.block_hash, ev.token_ids)
            pairs.append((ev.block_id, cpu_block))
        if not pairs:
            return 0
        ack = self.transfers.run(TransferKind.SWAP2CPU, gpu=[g for g, _ in pairs], cpu=[c.block_id for _, c in pairs])
        for j, (_, cpu_block) in enumerate(pairs):
            if j in ack.failed:
                self.pool.uncache(cpu_block)
        self.pool.free([c for _, c in pairs])
        kept = len(pairs) - len(ack.failed)
        self.counters.swap_out_blocks += kept
        return kept

    def flush(self) -> int:
        return 0 if self.pool is None else self.pool.uncache_all()

    def transfer_lost(self) -> None:
        pass  # lookups check transfers.usable; the pool is reset when a replacement is adopted

    def transfer_replaced(self, available: bool) -> None:
        self.pool = BlockPool(self.num_cpu_blocks) if available else None  # a new CTM's CPU tier is empty

    def check_integrity(self) -> None:
        if self.pool is not None:
            self.pool.check_integrity()
