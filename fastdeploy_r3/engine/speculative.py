"""Speculative decoding, the engine's half: drafters propose, the step carries the drafts, the worker
verifies, the token processor appends what was accepted.

Drafts are made HERE, in the engine, not in the worker: the engine holds every request's whole token
history (prompt + output) and its limits (max_tokens, max_model_len, the step's token budget), so a
draft never asks for a slot the scheduler did not reserve, and the worker stays stateless about
histories. A draft model (GLM's MTP layer; EAGLE-3 would be the same) needs the target's hidden
states, so it drafts in the worker, right after the step it follows (worker/mtp_drafter.py), and the
drafts come back with that step's tokens; WorkerDrafts holds them until the request's next step and
hands them to assign_drafts like any drafter's, cut by the same limits. Nothing downstream depends on
where drafts come from (the worker verifies whatever tokens follow a sampling chunk, the token
processor appends what comes back, the lookahead slots are reserved either way).

Exactness: a verify forward computes a draft position in matmuls over more rows than a decode step's,
so its float32 logits and router scores may differ from the plain engine's in the last bits (1e-6 on
the test model). Greedy tokens and R3 rows are then equal unless an argmax or a router's K-th /
(K+1)-th score is a near-tie at that level; tests/engine/test_spec_ngram.py sees none.

    scheduler ── chunk that samples ── assign_drafts ─► chunk.drafts (<= k, reserved lookahead slots)
    step_builder: token_ids = chunk + drafts, num_sample_rows = len(drafts) + 1
    worker (worker/model_runner.py, worker/sample/draw.py): one forward over every request's drafts;
        row i samples the token after draft i - 1; keep rows while the drawn token equals the draft
        fed after it (each row draws as plain decoding does), then the bonus token
    token_processor.append_tokens: accepted drafts + bonus, cut at a stop; the cursor advances over
        the verified ones only, so R3 rows and KV of rejected drafts are never published (see there)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fastdeploy_r3.config.speculative import SpeculativeConfig
from fastdeploy_r3.engine.request import Request
from fastdeploy_r3.engine.scheduler import ScheduledChunk


class Drafter(Protocol):
    def propose(self, token_ids: np.ndarray, max_drafts: int) -> list[int]:
        """Up to max_drafts draft ids to follow token_ids (int64 [L], a request's prompt + output), maybe none."""
        ...


class NgramDrafter:
    """Prompt lookup: the longest suffix n-gram of the history (n from prompt_lookup_max down to
    prompt_lookup_min) that occurred earlier in it; the drafts are the tokens that followed its first
    occurrence (as vLLM's prompt lookup does: a later one may overlap the suffix and leave fewer tokens,
    e.g. inside a run of one repeated token)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: np.ndarray | list[int], max_drafts: int) -> list[int]:
        tokens = token_ids if isinstance(token_ids, np.ndarray) else np.asarray(token_ids, dtype=np.int64)
        size = len(tokens)
        if max_drafts <= 0 or size < 2:
            return []
        # one pass over the history: where the last token occurred before (an n-gram ending there, at e <= L - 2,
        # is followed by e + 1); then each longer n only narrows those candidates, until none is left. Every
        # numpy call is ~1 us of the engine loop per request per step: no call that changes nothing
        ends = (tokens[:-1] == tokens[-1]).nonzero()[0]  # [C] ascending
        if not len(ends):
            return []
        best = ends if self.min_n <= 1 else None  # ends of the longest n-gram found so far, n >= min_n
        for n in range(2, min(self.max_n, size - 1) + 1):
            if ends[0] < n - 1:  # an n-gram cannot end there (ascending: only the first few)
                ends = ends[1:] if len(ends) > 1 and ends[1] >= n - 1 else ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[size - n]]
            if not len(ends):
                break
            if n >= self.min_n:
                best = ends
        if best is None:
            return []
        start = int(best[0]) + 1  # the first occurrence
        return tokens[start : start + max_drafts].tolist()


class RequestDrafter(Protocol):
    def propose_for(self, req: Request, token_ids: np.ndarray, max_drafts: int) -> list[int]:
        """Up to max_drafts drafts made elsewhere for this request to follow token_ids, maybe none."""
        ...


class WorkerDrafts:
    """MTP: the drafts the worker's draft layer made after a request's latest step (worker/mtp_drafter.py),
    held until its next step. They follow the tokens the request had once that step's were appended, so
    they are fed only if the request still has exactly those (a request cut at a stop, preempted or
    re-run gets none)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[Request, int, list[int]]] = {}  # id -> (request, num_tokens, drafts)

    def hold(self, req: Request, drafts: list[int]) -> None:
        self._held[req.request_id] = (req, req.num_tokens, drafts)

    def propose_for(self, req: Request, token_ids: np.ndarray, max_drafts: int) -> list[int]:
        held = self._held.pop(req.request_id, None)
        if held is None or held[0] is not req or held[1] != len(token_ids):
            return []
        return held[2][:max_drafts]

    def drop_finished(self) -> None:
        for rid in [rid for rid, (req, _, _) in self._held.items() if req.is_finished]:
            del self._held[rid]


def make_drafter(config: SpeculativeConfig) -> Drafter | RequestDrafter:
    if config.method == "ngram":
        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "mtp":
        return WorkerDrafts()
    raise ValueError(f"no drafter for speculative method {config.method!r}")  # SpeculativeConfig refuses it first


@dataclass
class SpecCounters:
    """Speculative decoding totals for /metrics (per request: Request.spec_*)."""

    verify_steps: int = 0  # engine steps that fed at least one draft
    draft_tokens: int = 0  # drafts fed
    accepted_tokens: int = 0  # drafts the target model agreed with


class Speculation:
    """The engine's speculative decoding: drafts for a step's chunks, counts of what was accepted."""

    def __init__(self, config: SpeculativeConfig, max_step_tokens: int, num_lookahead_tokens: int) -> None:
        """num_lookahead_tokens: the slots the scheduler reserves past a sampling chunk (what the workers
        asked for, WorkerReady); a draft never goes past them."""
        self.config = config
        self.drafter = make_drafter(config)
        self.max_step_tokens = max_step_tokens
        self.num_drafts = min(config.num_speculative_tokens, num_lookahead_tokens)
        self.counters = SpecCounters()
        self.histories = TokenHistories()

    def assign(self, chunks: list[ScheduledChunk], max_model_len: int) -> None:
        """Drafts for the chunks of a step about to be sent (kept on the chunks: a re-run sends the same)."""
        self.histories.keep_only({c.request.request_id for c in chunks})
        if isinstance(self.drafter, WorkerDrafts):
            self.drafter.drop_finished()
        if assign_drafts(chunks, self.drafter, self.num_drafts, self.max_step_tokens, max_model_len,
                         self.histories.of):
            self.counters.verify_steps += 1

    def worker_drafts(self, req: Request, drafts: list[int]) -> None:
        """The worker drafted these after the request's step (MTP), its tokens appended already."""
        if isinstance(self.drafter, WorkerDrafts) and not req.is_finished:
            self.drafter.hold(req, drafts)

    def record(self, chunk: ScheduledChunk, num_sampled: int) -> None:
        """The worker returned num_sampled tokens for a sampling chunk: its accepted drafts and one more."""
        req, accepted = chunk.request, max(num_sampled - 1, 0)
        self.counters.draft_tokens += len(chunk.drafts)
        self.counters.accepted_tokens += accepted
        # SGLang's meaning: every decode step of a speculative engine is a verify (maybe of no draft)
        req.spec_verify_ct += 1
        req.spec_draft_tokens += len(chunk.drafts)
        req.spec_accepted_tokens += accepted


class TokenHistories:
    """Each drafted request's tokens as one int64 array, extended by what it appended since the last step
    instead of rebuilt from the lists (a 32k-token history would cost the engine loop a millisecond per
    request per step). Kept only for the requests of the latest step: one that sits out a step (waiting,
    preempted, finished) is rebuilt if it comes back."""

    def __init__(self) -> None:
        # request id -> (the request, buffer, tokens filled); the request itself, since an id may be reused
        self._arrays: dict[str, tuple[Request, np.ndarray, int]] = {}

    def of(self, req: Request) -> np.ndarray:
        held, buf, filled = self._arrays.get(req.request_id, (req, np.empty(0, np.int64), 0))
        n, p = req.num_tokens, req.num_prompt_tokens
        if held is not req or filled > n:
            buf, filled = np.empty(0, np.int64), 0
        if n > len(buf):
            grown = np.empty(max(n, 2 * len(buf), 64), np.int64)
            grown[:filled] = buf[:filled]
            buf = grown
        if filled < p:
            buf[filled:p] = req.prompt_token_ids[filled:]
            filled = p
        buf[filled:n] = req.output_token_ids[filled - p :]
        self._arrays[req.request_id] = (req, buf, n)
        return buf[:n]

    def keep_only(self, request_ids: set[str]) -> None:
        for rid in [r for r in self._arrays if r not in request_ids]:
            del self._arrays[rid]


def assign_drafts(chunks: list[ScheduledChunk], drafter: Drafter | RequestDrafter, k: int, max_step_tokens: int,
                  max_model_len: int, history: Callable[[Request], np.ndarray] | None = None) -> int:
    """Give each chunk that samples up to k drafts; returns how many in all. A draft never goes past
    the request's max_tokens (the bonus token comes after the drafts), max_model_len, or the step's
    token budget (the routing capture holds max_num_batched_tokens rows). Requests with penalties get
    none: a step counts every drawn row for the penalties, and a rejected draft's row must not count.
    history(request): its tokens as an int64 array (TokenHistories.of; by default built from the lists)."""
    room = max_step_tokens - sum(c.num_new_tokens for c in chunks)
    total = 0
    # a RequestDrafter by its method: isinstance against a runtime-checkable Protocol cost ~20 us a request
    # per step on the engine's host (tools/engine_host_bench.py --speculative, cProfile)
    propose_for = getattr(drafter, "propose_for", None)
    for chunk in chunks:
        chunk.drafts = []
        req = chunk.request
        if not chunk.samples or chunk.ahead or room <= 0 or req.sampling_params.has_penalties:
            continue
        n = min(k, room, _tokens_left(req, max_model_len) - 1)
        if n <= 0:
            continue
        tokens = history(req) if history is not None else np.asarray(req.all_token_ids, dtype=np.int64)
        chunk.drafts = propose_for(req, tokens, n) if propose_for is not None else drafter.propose(tokens, n)
        room -= len(chunk.drafts)
        total += len(chunk.drafts)
    return total


def _tokens_left(req: Request, max_model_len: int) -> int:
    """Tokens the request may still append."""
    return min(req.sampling_params.max_tokens - len(req.output_token_ids), max_model_len - req.num_tokens)
