"""Block tables of requests over a tiered prefix cache: the GPU pool, then each KV connector in turn.

    request block_table:  [ g3 | g7 | g1 | g8 ]        g = GPU block id
                            hit  hit  load new          (hit: GPU prefix hit, load: from a connector,
                                                          the CPU tier or storage; new: computed now)

The bookkeeping only: block tables, the hash chain, the GPU pool's hits and eviction choices, and
every GPU block's routing_tag (the provenance of its R3 rows: fresh for a block computed here; for a
loaded block, the tag its connector says the rows carry). What lies behind the GPU pool (CPU tier,
storage tier, a prefill/decode transfer) is a KVConnector (kv_connector.py), asked in a fixed order
and waited for before the blocks it touches are used: evictions are copied out before the evicted
block is rewritten, loads finish before the step that reads them, and a block saved in the
background stays pinned (a reference) until its connector is done with it. A failed load costs
recomputation from that block on, never the request.

A load may also run in the background (admit(wait=False), tier_loads.py): the request is then
LOADING, its blocks held and not yet usable, until finish_loads() reports its num_computed_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from fastdeploy_r3.cache_manager.block_hash import block_hash as chain_hash
from fastdeploy_r3.cache_manager.block_pool import BlockPool, KVBlock
from fastdeploy_r3.cache_manager.kv_connector import BlockKey, CacheCounters, CachedBlock, KVConnector, PrefixHit
from fastdeploy_r3.cache_manager.prompt_tails import PromptTails, partial_block_key
from fastdeploy_r3.cache_manager.tier_loads import PendingAdmission, advance, check_loading, hashes_in_flight
from fastdeploy_r3.cache_manager.transfer import RemoteBlocks


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


class PrefixCacheManager:
    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        root_hash: bytes,
        connectors: Sequence[KVConnector] = (),  # asked in this order: the CPU tier before storage
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = root_hash
        self.gpu = BlockPool(num_gpu_blocks)
        self.connectors = list(connectors) if enable_prefix_caching else []
        self._counters = CacheCounters()  # the GPU pool's; each connector keeps its own
        self._blocks: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # hashes of the request's full blocks so far
        self._num_cached: dict[str, int] = {}  # leading blocks of the request registered in the pool
        self._pinned: dict[tuple[int, int], list[KVBlock]] = {}  # (connector index, save id) -> blocks it reads
        # requests whose KV predates the current root (in flight across a weight update): their blocks
        # mix two weight versions, so none of them is ever cached or stored
        self._stale: set[str] = set()
        self._next_tag = 1
        self._loading: dict[str, PendingAdmission] = {}  # admitted, some tier's load still running
        self._loaded: dict[str, int] = {}  # loads finished since finish_loads(): num_computed_tokens
        self._abandoned: list[PendingAdmission] = []  # freed while loading: blocks held until it answers
        self.tails = PromptTails(block_size)  # PD: the partial last prompt block (prompt_tails.py)

    # -- queries ------------------------------------------------------------------------------------

    @property
    def counters(self) -> CacheCounters:
        return sum((c.counters for c in self.connectors), self._counters)

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, [])]

    def block_tags(self, request_id: str) -> list[int]:
        return [b.routing_tag for b in self._blocks.get(request_id, [])]

    def blocks_since(self, request_id: str, start: int) -> tuple[list[int], list[int]]:
        """Ids and routing tags of the request's blocks from index `start` on (what a step's diff sends)."""
        new = self._blocks.get(request_id, [])[start:]
        return [b.block_id for b in new], [b.routing_tag for b in new]

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

    def expect_remote(self, request_id: str, remote: RemoteBlocks) -> bool:
        """A prefill server will write the request's prompt blocks (PD); False: no tier can take them
        (prefix caching or the storage tier off), and the request computes its prompt."""
        return any(c.expect_remote(request_id, remote) for c in self.connectors)

    def keep_prompt_tail(self, request_id: str, num_prompt_tokens: int) -> None:
        """A prefill server's request (PD): when it ends with its prompt computed, the prompt's partial last
        block is saved too (KVConnector.save_tail), for its decode server to load with the full ones."""
        if self.enable_prefix_caching:
            self.tails.keep(request_id, num_prompt_tokens)

    def expect_prompt_tail(self, request_id: str, num_prompt_tokens: int) -> None:
        """A decode server's request (PD) continuing a prompt of that length: the prefill server's partial last
        block is looked up after the full ones (a partial BlockKey), where it stored it or in its room."""
        if self.enable_prefix_caching:
            self.tails.expect(request_id, num_prompt_tokens)

    def find_cached_prefix(self, req: Request) -> PrefixHit | None:
        """The longest run of leading full blocks found in some tier (and the partial block after them a
        prefill server sent), capped so that at least the last token is computed (its logits sample the
        next token); None while a connector cannot say yet (a storage lookup still running: the first call
        starts it; try again next step), or while another request loads the first block missing from the
        GPU pool (it will be a GPU hit then)."""
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
        tail = self.tails.expected_key(req.request_id, tokens, hashes, self.root_hash)
        if not self.connectors or (i == len(hashes) and tail is None):
            return hit
        if i < len(hashes) and hashes[i] in set().union(*map(hashes_in_flight, self._loading.values())):
            return None
        keys = [BlockKey(h, self._block_tokens(tokens, j)) for j, h in enumerate(hashes)] + ([tail] if tail else [])
        for connector in self.connectors:
            tier_hit = connector.lookup(req.request_id, keys, i)
            if tier_hit is None:
                return None
            if tier_hit.keys:
                hit.tiers.append(tier_hit)
                i += len(tier_hit.keys)
        return hit

    def can_admit(self, hit: PrefixHit, num_new_tokens: int) -> bool:
        need = self.blocks_needed(hit.num_tokens(self.block_size) + num_new_tokens) - len(hit.gpu_blocks)
        revived = sum(1 for b in hit.gpu_blocks if b.ref_cnt == 0)  # leave the free list when touched
        return need <= self.gpu.num_free_blocks - revived

    def can_append(self, req: Request, num_new_tokens: int) -> bool:
        have = len(self._blocks.get(req.request_id, []))
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - have
        return need <= self.gpu.num_free_blocks

    def has_pending_lookups(self) -> bool:
        return any(c.pending() for c in self.connectors)

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._loading

    def has_loads_in_flight(self) -> bool:
        """Some admission (live or abandoned) waits for a connector's load."""
        return bool(self._loading or self._abandoned)

    def is_stale(self, request_id: str) -> bool:
        """The request's blocks predate the current weight root (reset_root)."""
        return request_id in self._stale

    # -- mutations ----------------------------------------------------------------------------------

    def admit(self, req: Request, hit: PrefixHit, num_new_tokens: int, wait: bool = True) -> int | None:
        """Give a waiting request its block table; returns its num_computed_tokens (the usable hit), or
        None (only when not `wait`) while a tier's load runs: finish_loads() reports it later.

        A block that fails to load truncates the hit there (later tiers are not asked to load); the
        blocks from it on are computed instead, so the caller schedules from the returned cursor."""
        assert req.request_id not in self._blocks, f"{req.request_id} admitted twice"
        self.gpu.touch(hit.gpu_blocks)
        for tier_hit in hit.tiers:
            tier_hit.connector.hold(tier_hit)  # before allocating: its swap-outs may evict the sources
        n_load = hit.num_blocks - len(hit.gpu_blocks)  # the partial block, if any, is the first of the new ones
        n_new = self.blocks_needed(hit.num_tokens(self.block_size) + num_new_tokens) - hit.num_blocks
        blocks = list(hit.gpu_blocks) + self._allocate(n_load + n_new)
        self._counters.gpu_hit_blocks += len(hit.gpu_blocks)
        self._blocks[req.request_id] = blocks
        self._num_cached[req.request_id] = len(hit.gpu_blocks)
        adm = PendingAdmission(req.request_id, blocks, list(hit.tiers), len(hit.gpu_blocks))
        if not advance(adm, self.gpu, self._new_tag, block=wait):
            self._loading[req.request_id] = adm
            return None
        return self._admitted(adm)

    def finish_loads(self, block: bool = False) -> dict[str, int]:
        """LOADING requests whose loads all answered since the last call: num_computed_tokens of each
        (their block tables are usable from it on). block=True: every load, waiting for each."""
        self._advance_loads(block)
        done, self._loaded = self._loaded, {}
        return done

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block until a load in flight may have answered (its ack), or timeout_s: an engine with
        nothing else to run waits here instead of spinning."""
        for connector in self.connectors:
            if connector.loads_in_flight():
                connector.wait_for_loads(timeout_s)
                return

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
        """Register the request's newly full, computed blocks; hand them to the connectors that save."""
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
                new_cached.append(blocks[i])
        self._num_cached[req.request_id] = num_full
        if not new_cached:
            return
        saved = [CachedBlock(b.block_id, b.block_hash, b.token_ids, b.routing_tag) for b in new_cached]  # type: ignore[arg-type]
        for index, connector in enumerate(self.connectors):
            save_id = connector.save(saved)
            if save_id is not None:
                self.gpu.touch(new_cached)  # pinned until the connector is done reading them
                self._pinned[(index, save_id)] = list(new_cached)

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
        """Forget every cached prefix in the GPU pool and the connectors that keep any (SGLang's
        /flush_cache); blocks in use keep their owners. Returns the number of entries dropped."""
        for adm in self._loading.values():
            adm.cache = False  # what it loads from now on serves the request, not the flushed cache
        return self.gpu.uncache_all() + sum(c.flush() for c in self.connectors)

    def reset_root(self, root_hash: bytes) -> None:
        """A new weight version: every hash from now on chains from root_hash, the caches are flushed,
        and requests already holding blocks (their KV computed by the old weights) never cache theirs.

        A request preempted later recomputes from scratch under the new weights, so it leaves the
        stale set when it frees its blocks."""
        self.root_hash = root_hash
        self.flush()
        self._stale.update(self._blocks)
        self._hashes.clear()

    def free(self, req: Request, returning: bool = False) -> None:
        """Release the request's blocks, tail first; cached ones stay cached. A LOADING request's blocks
        are released only once its load answered (the CTM may still write them). returning: it waits to be
        scheduled again (preempted), so its prompt tail (keep_prompt_tail, expect_prompt_tail) still stands."""
        if not returning:  # a prompt tail it was to keep is saved now or never
            self._save_tail(req, self.tails.forget(req.request_id))
        self._stale.discard(req.request_id)
        self._loaded.pop(req.request_id, None)
        blocks = self._blocks.pop(req.request_id, [])
        adm = self._loading.pop(req.request_id, None)
        if adm is not None:
            adm.abandoned, adm.cache = True, False
            self._abandoned.append(adm)
            self._advance_loads(block=False)  # maybe it answered already
        else:
            self.gpu.free(list(reversed(blocks)))
        self._num_cached.pop(req.request_id, None)
        self._hashes.pop(req.request_id, None)
        for connector in self.connectors:
            connector.on_free(req.request_id)

    def poll_transfers(self, block: bool = False) -> None:
        """Unpin blocks whose background save is done, move loads on (all of them when block=True)."""
        for index, connector in enumerate(self.connectors):
            for save_id in connector.poll(block):
                pinned = self._pinned.pop((index, save_id), None)
                if pinned is not None:
                    self.gpu.free(pinned)
        self._advance_loads(block)  # load acks were taken with the saves'

    def saves_in_flight(self) -> frozenset[tuple[int, int]]:
        """(connector index, save id) of every background save not done yet; what engine/write_through.py
        waits out for a prefill server's handoff, a step at a time."""
        return frozenset(self._pinned)

    def close(self) -> None:
        """Close every connector (their threads and store connections); once, at engine shutdown."""
        for connector in self.connectors:
            connector.close()

    # -- internals ----------------------------------------------------------------------------------

    def _new_tag(self) -> int:
        tag, self._next_tag = self._next_tag, self._next_tag + 1
        return tag

    def _admitted(self, adm: PendingAdmission) -> int:
        """Every load of the admission answered: blocks from the first one not in place are computed."""
        for b in adm.blocks[adm.usable + (1 if adm.partial_tokens else 0) :]:
            # computed here: blocks after a failed load lose whatever a partial load left behind
            self.gpu.uncache(b)
            b.routing_tag = self._new_tag()
        self._num_cached[adm.request_id] = adm.usable
        return adm.usable * self.block_size + adm.partial_tokens

    def _save_tail(self, req: Request, num_prompt: int | None) -> None:
        """keep_prompt_tail's save as the request frees its blocks (pinned until the connector read it)."""
        if num_prompt is None:
            return
        rid, full, blocks = req.request_id, num_prompt // self.block_size, self._blocks.get(req.request_id, [])
        if rid in self._stale or rid in self._loading or req.num_computed_tokens < num_prompt or len(blocks) <= full:
            return
        b, key = blocks[full], partial_block_key(req.all_token_ids[:num_prompt], self._request_hashes(req, full),
                                                 self.root_hash, self.block_size)  # fmt: skip
        for index, connector in enumerate(self.connectors):
            save_id = connector.save_tail(CachedBlock(b.block_id, key.block_hash, key.token_ids, b.routing_tag))
            if save_id is not None:
                self.gpu.touch([b])
                self._pinned[(index, save_id)] = [b]

    def _advance_loads(self, block: bool) -> None:
        for rid, adm in list(self._loading.items()):
            if advance(adm, self.gpu, self._new_tag, block):
                del self._loading[rid]
                self._loaded[rid] = self._admitted(adm)
        still = []
        for adm in self._abandoned:
            if advance(adm, self.gpu, self._new_tag, block):
                for b in adm.blocks[adm.usable :]:
                    self.gpu.uncache(b)  # a partial load's later blocks are no data
                self.gpu.free(list(reversed(adm.blocks)))
            else:
                still.append(adm)
        self._abandoned = still

    def _allocate(self, n: int) -> list[KVBlock]:
        """n GPU blocks; cached blocks evicted to make room are offered to the connectors first."""
        blocks = self.gpu.allocate(n)
        evicted = self.gpu.pop_evicted()
        if evicted:
            self._counters.evicted_blocks += len(evicted)
            gone = [CachedBlock(e.block_id, e.block_hash, e.token_ids, e.routing_tag) for e in evicted]
            kept = max((c.evicted(gone) for c in self.connectors), default=0)
            self._counters.dropped_blocks += len(evicted) - kept
        return blocks

    # -- tests --------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        self.gpu.check_integrity()
        for connector in self.connectors:
            connector.check_integrity()
        for rid, adm in self._loading.items():
            assert self._blocks.get(rid) is adm.blocks, f"{rid} is loading into blocks it does not own"
            check_loading(adm)
        for adm in self._abandoned:
            check_loading(adm)
        held = [adm.blocks for adm in self._abandoned]  # freed while loading: held until the load answers
        owners: dict[int, int] = {}
        for b in [b for blocks in [*self._blocks.values(), *self._pinned.values(), *held] for b in blocks]:
            owners[b.block_id] = owners.get(b.block_id, 0) + 1
        for b in self.gpu.blocks:
            owned = owners.get(b.block_id, 0)
            assert b.ref_cnt == owned, f"{b} has ref_cnt {b.ref_cnt} but {owned} owners"
