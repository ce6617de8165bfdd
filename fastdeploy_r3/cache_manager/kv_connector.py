"""The KV connector interface: a place a request's full blocks can be loaded from into the GPU pool,
or saved to from it, other than the GPU pool itself.

    PrefixCacheManager (bookkeeping: block tables, hash chain, GPU pool, tags)
        │ lookup / hold / start_load / finish_load      admission: GPU hit, then each connector in turn
        │ save / evicted / poll                         computed blocks, evictions, finished saves
        │ on_free / flush / close
        ├── CpuTier      (cpu_tier.py)       swap out on eviction, swap in on a hit     ┐ through the
        └── StorageTier  (storage_tier.py)   write-through, lookups off the loop, loads ┘ CTM;
                                             and a prefill server's room (PD), written in place

The manager owns the GPU blocks and their routing tags; a connector owns what lies behind it (the
CPU pool, the store's index, a peer). It sees GPU blocks only as ids handed to it, and it never
decides a tag: a load is told the fresh tag of each destination block and answers which tag the
rows it put there carry (the CPU tier's rows keep the tag they were swapped out with; rows from a
store or a peer are data only under the fresh tag). The bytes themselves (KV with its rows, always
together) move through cache_manager/block_copy.py in whichever process does the copy, or, from a
prefill server, land in place over the transfer engine, KV and rows in the same transfer.

How the prefill/decode transfer plugs in (built into the storage tier, whose loads it shares):
  expect_remote on D, the request P handed over: the room, and each of its blocks' blob digest
  lookup       every prompt block of the room is "found" (P computed it), its partial last one too when
               P sent one and the request asks for it (BlockKey.partial)
  start_load   a PD2GPU task: the CTM asks P to write the blocks' pieces (KV of every rank and layer,
               the rows) straight into the GPU blocks D reserved; it checks each block's digest and
               stamps the good leading ones with their fresh tags (cache_manager/pd_receive.py)
  finish_load  block=False: None while the bytes are on the wire, so the scheduler keeps the request
               LOADING (as vLLM's WAITING_FOR_REMOTE_KVS) instead of running a step on blocks not yet
               written; a failed or partial transfer costs recomputation from the first bad block
  on_free      forgets the room.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field, fields

from fastdeploy_r3.cache_manager.block_pool import KVBlock
from fastdeploy_r3.cache_manager.transfer import RemoteBlocks


@dataclass(frozen=True)
class BlockKey:
    """A full block of a request as every tier addresses it: its chain hash, and the token ids a hit
    must hold (tiers that keep them compare them; a store trusts the 128-bit hash). Or, partial, the
    prompt's partial last block a prefill server stored (PD): the chain hash of the fewer tokens it holds,
    never cached in the GPU or CPU pool, and only ever the last key of a lookup."""

    block_hash: bytes
    token_ids: tuple[int, ...]
    partial: bool = False


@dataclass(frozen=True)
class CachedBlock:
    """A full, computed GPU block with a hash: what save() and evicted() are told."""

    block_id: int
    block_hash: bytes
    token_ids: tuple[int, ...]
    routing_tag: int  # who wrote its R3 rows (routing_buffer.py)


@dataclass
class TierHit:
    """The leading run of a request's next blocks that one connector can load, from its lookup()."""

    connector: KVConnector
    keys: list[BlockKey] = field(default_factory=list)
    sources: list = field(default_factory=list)  # the connector's own handles (CPU tier: its blocks)
    pending: object = None  # the connector's, from start_load to finish_load (e.g. its task's ack)

    @property
    def num_full(self) -> int:
        return len(self.keys) - (1 if self.partial_tokens else 0)

    @property
    def partial_tokens(self) -> int:
        """Tokens of the partial last block the hit ends with (BlockKey.partial), else 0."""
        return len(self.keys[-1].token_ids) if self.keys and self.keys[-1].partial else 0


@dataclass
class PrefixHit:
    """Leading full blocks of a request found in some tier, in order: GPU, then each connector's."""

    gpu_blocks: list[KVBlock] = field(default_factory=list)
    tiers: list[TierHit] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        """Full blocks found."""
        return len(self.gpu_blocks) + sum(t.num_full for t in self.tiers)

    @property
    def partial_tokens(self) -> int:
        """Tokens of the prompt's partial last block found after the full ones (a prefill server's, PD)."""
        return self.tiers[-1].partial_tokens if self.tiers else 0

    def num_tokens(self, block_size: int) -> int:
        return self.num_blocks * block_size + self.partial_tokens


@dataclass(frozen=True)
class LoadResult:
    """The leading blocks of a load that are in place, with the tag their rows carry, one per block.
    A block after the first failure never counts, even if its bytes arrived: the request computes
    from the first missing block on."""

    tags: list[int]

    @property
    def num_loaded(self) -> int:
        return len(self.tags)


@dataclass
class CacheCounters:
    """Totals since start; the manager adds its own and every connector's (field by field)."""

    gpu_hit_blocks: int = 0
    swap_in_blocks: int = 0
    swap_out_blocks: int = 0
    storage_load_blocks: int = 0
    storage_load_failed_blocks: int = 0
    storage_put_blocks: int = 0
    evicted_blocks: int = 0
    dropped_blocks: int = 0  # evicted with nowhere to go

    def __add__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


class KVConnector(abc.ABC):
    """One tier behind the GPU pool. Called from the engine loop only (not thread-safe).

    The load protocol, per admitted request and connector, in this order:
      lookup(rid, keys, start)     pure: what the tier holds now; may be asked again next step
      hold(hit)                    before the GPU blocks are allocated: allocating may evict into
                                   this very tier, which must not drop the hit's sources
      start_load(hit, dst, tags)   copy hit.keys into GPU blocks dst (a prefix of hit.keys: the
                                   manager may load fewer than were found)
      finish_load(hit, block)      the result, once; releases what hold() kept. block=False: None
                                   while the bytes are moving (the manager asks again later; the
                                   GPU blocks stay held, so nothing else is written into them)
    A failed or partial load costs recomputation, never the request.
    """

    name: str = "tier"
    counters: CacheCounters

    # -- admission ----------------------------------------------------------------------------------

    @abc.abstractmethod
    def lookup(self, request_id: str, keys: list[BlockKey], start: int) -> TierHit | None:
        """The leading run of keys[start:] this tier can load (maybe empty); None while it cannot say yet.
        `keys` are all the request's full blocks (a tier may remember its answer for them); the ones
        before `start` were found in the GPU pool or an earlier tier. Changes nothing a later lookup
        or load would see."""

    def hold(self, hit: TierHit) -> None:  # noqa: B027 - a tier without sources to pin has nothing to do
        """Keep the hit's sources until finish_load (called once per hit that will be loaded)."""

    @abc.abstractmethod
    def start_load(self, hit: TierHit, gpu_block_ids: list[int], fresh_tags: list[int]) -> None:
        """Begin copying hit.keys[:len(gpu_block_ids)] into those GPU blocks; fresh_tags[i] is the tag
        the manager gave block i, for rows that arrive without a tag of this engine."""

    @abc.abstractmethod
    def finish_load(self, hit: TierHit, block: bool = True) -> LoadResult | None:
        """The started load's result; None only when block=False and it is still running."""

    def loads_in_flight(self) -> bool:
        """Some started load has not answered yet (finish_load(block=False) would say None)."""
        return False

    def wait_for_loads(self, timeout_s: float) -> None:  # noqa: B027 - a tier whose loads end at once never waits
        """Block until a load in flight may have finished, or timeout_s passed (not a sleep: an engine
        with nothing else to do waits here and must wake as soon as the bytes are in)."""

    # -- blocks leaving the GPU pool ----------------------------------------------------------------

    def save(self, blocks: list[CachedBlock]) -> int | None:
        """Newly cached GPU blocks (write-through). Returns a save id while the tier reads them in the
        background (the manager pins them until poll() returns the id), None when it took nothing."""
        return None

    def save_tail(self, block: CachedBlock) -> int | None:
        """A prefill server's partial last prompt block (PD), its token_ids the ones it holds, stored under
        block_hash (the chain hash of those tokens) for the decode server: a save id as save() gives, or
        None when the tier keeps no such blocks."""
        return None

    def evicted(self, blocks: list[CachedBlock]) -> int:
        """Cached GPU blocks that are about to be rewritten: copy what the tier keeps before returning.
        Returns how many it kept."""
        return 0

    def poll(self, block: bool = False) -> list[int]:
        """Save ids that are done with their GPU blocks (stored, failed, or abandoned with a lost
        transfer); with block=True, all of them."""
        return []

    # -- life ---------------------------------------------------------------------------------------

    def expect_remote(self, request_id: str, remote: RemoteBlocks) -> bool:
        """A prefill server will write the request's prompt blocks (PD): whether this tier loads them."""
        return False

    def on_free(self, request_id: str) -> None:  # noqa: B027 - stateless tiers keep nothing per request
        """The request released its blocks: forget what the tier kept for it (a lookup's answer)."""

    def pending(self) -> bool:
        """Some lookup is still running (an idle engine then waits a little rather than spinning)."""
        return False

    def flush(self) -> int:
        """Forget every cached prefix the tier holds for this weight version; returns how many. A
        tier keyed by the weight version (the storage tier) keeps them: nobody else can hit them."""
        return 0

    def close(self) -> None:  # noqa: B027 - a tier holding no resources has nothing to release
        """Release what the tier holds open (threads, store connections). Called once, at shutdown."""

    def check_integrity(self) -> None:  # noqa: B027 - a tier without a pool has nothing to check
        """Raise AssertionError if the tier's own bookkeeping disagrees with itself (tests)."""
