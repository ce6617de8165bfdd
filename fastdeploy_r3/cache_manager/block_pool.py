"""A pool of fixed-size KV blocks with ref counts, an LRU free list and a hash → block map.

    free list (LRU → MRU):  [ 7  2  9  4 ]      allocate() pops from the left;
                              ^ cached (hash kept) until popped: then it is evicted
    ref_cnt > 0  → owned by requests (or pinned by an in-flight transfer), never in the free list
    ref_cnt == 0 → in the free list; if it carries a hash it can still be hit and revived by touch()

Cached blocks are immutable: a block with a hash is never written again until evicted. A cached block
keeps the token ids it holds, and lookup() compares them on a hash hit (as nano-vllm's block manager
does): a hash collision is a miss, never another prompt's KV and routing.
Used for both the GPU tier and the CPU tier (the CPU tier only stores cached blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # set with block_hash: what lookup() compares on a hit
    routing_tag: int = 0  # provenance of the R3 rows in this block (see routing_buffer.py)

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h}, tag={self.routing_tag})"


@dataclass(frozen=True)
class EvictedBlock:
    """A cached block whose hash was dropped from the pool; its data stays intact until rewritten."""

    block_id: int
    block_hash: bytes
    token_ids: tuple[int, ...]
    routing_tag: int


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._evicted: list[EvictedBlock] = []
        self.num_evictions = 0

    # -- queries ------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...] | list[int]) -> KVBlock | None:
        """The cached block holding exactly these token ids under this hash; None on a miss or a collision."""
        block = self.cached_block(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cached_block(self, block_hash: bytes) -> KVBlock | None:
        """The block registered under a hash, tokens unchecked (introspection; admissions use lookup)."""
        bid = self._cached.get(block_hash)
        return None if bid is None else self.blocks[bid]

    def free_block_ids(self) -> list[int]:
        """Free list in LRU order (for tests)."""
        return list(self._free)

    # -- mutations ----------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[KVBlock]:
        """n blocks with ref_cnt 1, taken LRU-first; cached ones among them are evicted."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            block = self.blocks[bid]
            if block.block_hash is not None:
                assert block.token_ids is not None
                self._evicted.append(EvictedBlock(bid, block.block_hash, block.token_ids, block.routing_tag))
                del self._cached[block.block_hash]
                block.block_hash, block.token_ids = None, None
                self.num_evictions += 1
            block.routing_tag = 0
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference; a cached free block leaves the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop a reference each; blocks reaching 0 join the MRU end in the order given.

        Callers pass a request's blocks in reverse, so its tail is evicted before its prefix.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache(self, block: KVBlock, block_hash: bytes, token_ids: tuple[int, ...] | list[int]) -> bool:
        """Register a full, computed block holding token_ids under its hash. False if the hash is already
        cached elsewhere (the block stays uncached)."""
        if block.block_hash is not None:
            return block.block_hash == block_hash and block.token_ids == tuple(token_ids)
        if block_hash in self._cached:
            return False
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self._cached[block_hash] = block.block_id
        return True

    def uncache(self, block: KVBlock) -> None:
        """Forget a block's hash (e.g. a transfer into it failed) without evicting it as data."""
        if block.block_hash is not None:
            self._cached.pop(block.block_hash, None)
            block.block_hash, block.token_ids = None, None

    def pop_evicted(self) -> list[EvictedBlock]:
        out, self._evicted = self._evicted, []
        return out

    # -- tests --------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError if the free list, ref counts and hash map disagree."""
        for block in self.blocks:
            in_free = block.block_id in self._free
            assert block.ref_cnt >= 0, block
            assert in_free == (block.ref_cnt == 0), f"{block} free-list membership wrong"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id, f"{block} not in hash map"
        for h, bid in self._cached.items():
            assert self.blocks[bid].block_hash == h, f"hash map points {h.hex()[:8]} at {self.blocks[bid]}"
        assert len(self._free) + sum(1 for b in self.blocks if b.ref_cnt > 0) == self.num_blocks
