"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Each step every scheduled request advances num_computed_tokens towards num_tokens by at most
the budget left. Running requests go first (oldest first); when blocks run out the youngest running
request is preempted (its blocks go back to the pool, cached ones stay cached) and recomputes later.
Waiting requests are admitted in arrival order, each first looking up its prefix in the cache tiers.

A request whose prefix hit must come from the storage tier is admitted LOADING (nonblocking_loads):
its blocks are allocated and held while the cache transfer manager writes them, and every other
request keeps stepping. It is not scheduled, not preempted (it is in no running list) and, when
released, its blocks go back only once the load answered (prefix_cache_manager.free). When the load
answers it joins `running` at num_computed_tokens (a failed block: computed from there):

    waiting ──admit──► loading ──load answered──► running       (a weight update while it loaded:
                │                   │                            back to waiting, recomputed)
                └─ answered at once ┘  (GPU hits, CPU tier, blocking loads)

A chunk that reaches the last token samples; its step may append several tokens (token_processor.py),
the ones before the last having been fed in the same step at the positions after the chunk. Those
`num_lookahead_tokens` slots are reserved with the chunk (0 while every step appends one token):

    block table:  [ computed | chunk (num_new_tokens) | lookahead ]   the last token sampled is never fed
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fastdeploy_r3.cache_manager.prefix_cache_manager import PrefixCacheManager, PrefixHit
from fastdeploy_r3.engine.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    request: Request
    num_new_tokens: int  # tokens fed this step: [start, start + num_new_tokens)
    start: int = -1  # num_computed_tokens when scheduled
    # scheduled ahead (engine/overlap.py): the chunk feeds the one token that the step in flight samples
    # for the request, unknown to the engine when sent (the worker fills it in); it samples the next one
    ahead: bool = False
    # speculative drafts fed after the chunk into its lookahead slots and verified by the step
    # (engine/speculative.py): not counted in num_new_tokens, since only the accepted ones are computed
    drafts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.start < 0:
            self.start = self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the last token, so its step samples the next token(s)."""
        return self.ahead or self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later (HTTP 429)."""


class Scheduler:
    def __init__(
        self,
        kv: PrefixCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
        max_waiting: int | None = None,
        num_lookahead_tokens: int = 0,
        max_model_len: int | None = None,
        nonblocking_loads: bool = False,
    ) -> None:
        """nonblocking_loads: storage-tier hits load while the engine steps (the engine's default, see
        builder.py); False: admission waits for every load, as a scheduler built on its own does."""
        self.kv = kv
        self.nonblocking_loads = nonblocking_loads
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_model_len = max_model_len  # no lookahead slot past it (None: unbounded)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_waiting = max_waiting  # None: unbounded
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: list[Request] = []  # admitted, their prefix still loading (oldest first)
        self.num_preemptions = 0

    def can_accept(self, num_requests: int) -> bool:
        """Whether `num_requests` more fit in the waiting queue. An empty queue takes any number, so
        that a request with more choices than the bound is served rather than refused forever.
        (Preempted requests re-enter the queue whatever its length.)"""
        if self.max_waiting is None or not self.waiting:
            return True
        return len(self.waiting) + num_requests <= self.max_waiting

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def poll_loads(self, block: bool = False) -> bool:
        """Move LOADING requests whose loads answered to `running`, at the cursor the load left them
        (block: wait for every load); whether any moved there."""
        if not self.loading:
            return False
        moved = False
        by_id = {r.request_id: r for r in self.loading}
        for rid, num_computed in self.kv.finish_loads(block).items():
            req = by_id.get(rid)
            if req is None:
                continue
            self.loading.remove(req)
            if self.kv.is_stale(rid):
                # new weights came while it loaded: its prefix is the old weights' KV, which no event of
                # the update recorded (it had computed nothing yet), so it recomputes under the new ones
                self.kv.free(req, returning=True)
                req.status, req.num_computed_tokens = RequestStatus.WAITING, 0
                self.waiting.appendleft(req)
                continue
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            moved = True
        return moved

    def schedule(self) -> SchedulerOutput:
        self.poll_loads()
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()

        # 1. running requests, oldest first; preempt the youngest when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            slots = num_new + self._lookahead(req, req.num_computed_tokens + num_new)
            while not self.kv.can_append(req, slots):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req itself was preempted: everything after it already was
            self.kv.append_slots(req, slots)
            out.chunks.append(ScheduledChunk(req, num_new))
            scheduled.add(req.request_id)
            budget -= num_new
            i += 1
        # drop chunks of requests preempted after they were scheduled
        out.chunks = [c for c in out.chunks if c.request.status is RequestStatus.RUNNING]
        budget = self.max_num_batched_tokens - out.num_tokens

        # 2. waiting requests in order, unless this step had to preempt; one whose storage lookup is
        # still running keeps its place and lets the next ones go (a slow store delays only its own)
        for req in list(self.waiting):
            if out.preempted or budget <= 0 or len(self.running) + len(self.loading) >= self.max_num_seqs:
                break
            # prompt logprobs need the logits of every prompt position: no prefix hit may skip one
            hit = PrefixHit() if req.needs_prompt_logprobs else self.kv.find_cached_prefix(req)
            if hit is None:
                continue
            hit_tokens = hit.num_tokens(self.kv.block_size)  # a partial block only from a prefill server
            num_new = req.num_tokens - hit_tokens
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            look = self._lookahead(req, hit_tokens + num_new)
            if not self.kv.can_admit(hit, num_new + look):
                break
            self.waiting.remove(req)
            num_computed = self.kv.admit(req, hit, num_new + look, wait=not self.nonblocking_loads)
            if num_computed is None:  # a load runs: scheduled once it answered (poll_loads)
                req.status = RequestStatus.LOADING
                self.loading.append(req)
                continue
            # a failed load leaves fewer usable tokens; the allocated blocks bound what we compute now
            covered = hit_tokens + num_new
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_new = min(covered - num_computed, budget, req.num_tokens - num_computed)
            out.chunks.append(ScheduledChunk(req, num_new))
            budget -= num_new
        return out

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance cursors of what was computed; register newly full blocks in the prefix cache."""
        for chunk in out.chunks:
            self.advance(chunk.request, chunk.num_new_tokens)

    def advance(self, req: Request, num_tokens: int) -> None:
        """num_tokens more of the request's tokens have KV (and R3 rows) written: move its cursor and
        register its newly full blocks (a verified draft is computed like a chunk's token)."""
        req.num_computed_tokens += num_tokens
        self.kv.cache_computed_blocks(req)

    def _lookahead(self, req: Request, chunk_end: int) -> int:
        """Slots to reserve past a chunk ending at chunk_end: only a chunk that samples feeds more, and
        never past max_model_len: a request holds at most max_model_len tokens, and the last one it
        samples is never fed, so a verify step's drafts end at position max_model_len - 2."""
        if chunk_end != req.num_tokens:
            return 0
        if self.max_model_len is None:
            return self.num_lookahead_tokens
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - 1 - chunk_end))

    def release(self, req: Request, status: RequestStatus) -> None:
        """Leave the queues and give the blocks back. R3 must have been gathered before this."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.loading:
            self.loading.remove(req)  # kv.free holds its blocks until the load answered
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)

    def retract_running(self) -> int:
        """Every running request back to the front of the waiting queue, oldest first, its KV freed (cached
        blocks stay cached): /pause_generation mode 'retract'. They recompute when scheduled again.
        LOADING requests go back too (behind them): their loads are abandoned, their blocks freed once
        the loads answered."""
        retracted = list(self.running) + list(self.loading)
        for req in reversed(retracted):
            self._preempt(req)
        return len(retracted)

    def _preempt(self, req: Request) -> None:
        if req in self.loading:
            self.loading.remove(req)
        else:
            self.running.remove(req)
        self.kv.free(req, returning=True)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
