"""Turns sampled tokens into request progress: append, detokenize incrementally, stop checks, and at
finish gather R3 (before the blocks are freed), then free; `take_delta` hands out what is new.

A step may append several tokens to a request (a verify step of speculative decoding accepts its
drafts and adds a bonus token; an overlapped step is one token ahead). Every token of the list but
the last was fed in that step, so its KV and R3 row are written:

    sampled [t0 t1 t2 t3]   stop at t2  ->  kept [t0 t1 t2]; t3 dropped (its row is never published)
    num_computed_tokens     += 2 (t0, t1 were fed as drafts)  ->  num_tokens - 1, as after any step
    finish                  ->  gather R3 rows [start, P + N - 1) through the block table -> release

Text for the caller is sent as deltas: each step's new characters, minus the last (longest stop
string - 1) characters while the request runs, since a stop string beginning there would cut them.

Only requests with stop strings need their text here. With `detokenize_all` off (the engine process:
the API server detokenizes, off the engine loop) the others' deltas carry token ids and a TextRule
(outputs.py) saying how the receiver's DeltaDetokenizer (engine/detokenizer.py) turns them into the
same text this class would have made.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from fastdeploy_r3.cache_manager.routing_cache_manager import RoutingCacheManager
from fastdeploy_r3.engine.detokenizer import Decoding, IncrementalDetokenizer
from fastdeploy_r3.engine.request import Request, RequestStatus
from fastdeploy_r3.engine.scheduler import Scheduler
from fastdeploy_r3.logprobs import PromptLogprobs, TokenLogprob
from fastdeploy_r3.outputs import TextRule
from fastdeploy_r3.r3.errors import RoutingReplayError
from fastdeploy_r3.r3.layouts import row_range


@dataclass
class R3Counters:
    rows_delivered: int = 0
    bytes_delivered: int = 0
    failures: int = 0
    gather_seconds: float = 0.0


@dataclass
class OutputState:
    """What the caller is owed of one request, beside the scheduler's cursors on Request: text held
    back while a stop string could still begin in it, what the deltas carried so far, how it ended."""

    detokenizer: IncrementalDetokenizer | None = None
    pending_text: str = ""
    num_sent_tokens: int = 0
    delta_finished: bool = False  # the delta carrying its finish went out
    num_returned_tokens: int | None = None  # N: output tokens returned to the user, set at finish
    stop_reason: str | int | None = None
    error: str | None = None
    finish_message: str | None = None  # why an aborted request stopped, in words
    routed_experts: np.ndarray | None = None
    # logprobs (fastdeploy_r3/logprobs.py), when the params ask: one record per output token, and the
    # prompt's (entry 0 None) filled chunk by chunk; prompt_logprobs_sent once a delta carried them
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: PromptLogprobs | None = field(default=None, repr=False)
    prompt_logprobs_sent: bool = False
    text_rule: TextRule = TextRule.IN_TEXT  # not IN_TEXT: the receiver detokenizes (see the module's doc)


class TokenProcessor:
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: object | None,
        eos_token_ids: list[int],
        max_model_len: int,
        routing: RoutingCacheManager | None,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.routing = routing
        self.r3 = R3Counters()
        self._outputs: dict[str, OutputState] = {}
        # off: requests without stop strings are detokenized by the receiver of their deltas
        self.detokenize_all = True

    def output(self, req: Request) -> OutputState:
        """The request's output state, created on first use."""
        out = self._outputs.get(req.request_id)
        if out is None:
            params = req.sampling_params
            out = self._outputs[req.request_id] = OutputState(
                logprobs=[] if params.logprobs is not None else None,
                prompt_logprobs=[None] * req.num_prompt_tokens if params.prompt_logprobs is not None else None,
                text_rule=(TextRule.IN_TEXT if self.tokenizer is None or self.detokenize_all or params.stop
                           else TextRule.PUSH),
            )
        return out

    def forget(self, request_id: str) -> None:
        """Drop the output state of a request whose finishing delta went out."""
        self._outputs.pop(request_id, None)

    def add_prompt_logprobs(self, req: Request, first_position: int, records: list[TokenLogprob]) -> None:
        """Entries for prompt positions first_position.. (a recompute after preemption rewrites the same)."""
        scored = self.output(req).prompt_logprobs
        assert scored is not None
        scored[first_position : first_position + len(records)] = records
        req.needs_prompt_logprobs = any(p is None for p in scored[1:])

    def append_token(self, req: Request, token_id: int, logprob: TokenLogprob | None = None) -> None:
        """One sampled token: append_tokens with a list of one."""
        self.append_tokens(req, [token_id], None if logprob is None else [logprob])

    def append_tokens(self, req: Request, token_ids: list[int], logprobs: list[TokenLogprob] | None = None) -> int:
        """Record the tokens one step sampled for `req` (and their logprob records, when it asked for
        logprobs), in order, up to the first that stops it; later ones are dropped. Before min_tokens
        tokens nothing but the length stops it. Returns how many were kept."""
        out = self.output(req)
        if out.logprobs is not None and (logprobs is None or len(logprobs) < len(token_ids)):
            # never expected; fail this request, not the engine
            self.finish(req, RequestStatus.FINISHED_ERROR,
                        error=f"request {req.request_id} asked for logprobs but the worker sent none")
            return 0
        kept = 0
        status: RequestStatus | None = None
        for j, token_id in enumerate(token_ids):
            req.output_token_ids.append(token_id)
            if out.logprobs is not None:
                assert logprobs is not None
                out.logprobs.append(logprobs[j])
            kept += 1
            status = self._stop_status(req, out, token_id)
            if status is not None:
                break
        if kept > 1:
            # INVARIANT (speculative decoding, engine/speculative.py): the cursor moves over the kept tokens
            # before the last, i.e. accepted drafts cut at a stop, never over a rejected or dropped one.
            # R3 rows are gathered only below the cursor (_gather_r3) and only blocks full below it are
            # cached, so the rows and KV a verify step wrote for unverified drafts are never published
            # (the next step writes the true tokens' over them)
            self.scheduler.advance(req, kept - 1)  # the kept tokens before the last were fed this step
        if status is not None:
            self.finish(req, status)
        return kept

    def _stop_status(self, req: Request, out: OutputState, token_id: int) -> RequestStatus | None:
        """Whether `req` stops at its newest token, `token_id`; its text goes to pending_text, cut at a stop string."""
        params = req.sampling_params
        may_stop = len(req.output_token_ids) >= params.min_tokens
        status: RequestStatus | None = None
        if may_stop and token_id in params.stop_token_ids:
            status, out.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
        elif may_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        at_length = len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.max_model_len
        if out.text_rule is not TextRule.IN_TEXT:
            # the receiver detokenizes: tell it what the branch below would do with this token
            if status is not None and not params.include_stop_str_in_output:
                out.text_rule = TextRule.PUSH_BUT_LAST_FLUSH
            elif status is not None or at_length:
                out.text_rule = TextRule.PUSH_FLUSH
        elif self.tokenizer is not None:
            if out.detokenizer is None:
                out.detokenizer = IncrementalDetokenizer(
                    Decoding(self.tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens))
            if status is not None and not params.include_stop_str_in_output:
                # the stop token's own text is trimmed, as vLLM does and SGLang unless no_stop_trim
                # (it stays in token_ids)
                new_text = out.detokenizer.flush()
            else:
                new_text = out.detokenizer.push([token_id])
                if status is not None or at_length:
                    new_text += out.detokenizer.flush()
            searched = len(out.pending_text)
            out.pending_text += new_text
            if params.stop and status is None and new_text and may_stop:
                cut = _find_stop(out.pending_text, params.stop, searched)
                if cut is not None:
                    end = cut[0] + len(cut[1]) if params.include_stop_str_in_output else cut[0]
                    out.pending_text = out.pending_text[:end]
                    out.stop_reason = cut[1]
                    status = RequestStatus.FINISHED_STOPPED
        if status is None and at_length:
            status = RequestStatus.FINISHED_LENGTH
        return status

    def finish(self, req: Request, status: RequestStatus, error: str | None = None, message: str | None = None) -> None:
        """Gather R3 (if wanted), then give the blocks back. `message`: why an aborted request stopped."""
        out = self.output(req)
        if message is not None:
            out.finish_message = message
        if out.num_returned_tokens is None:
            out.num_returned_tokens = len(req.output_token_ids)
        if error is None and status is not RequestStatus.FINISHED_ABORTED and self._wants_r3(req):
            try:
                out.routed_experts = self._gather_r3(req, out.num_returned_tokens)
            except RoutingReplayError as e:
                self.r3.failures += 1
                # fail closed for this request, and let the next one recompute instead of failing too
                self.scheduler.kv.forget_cached(req.request_id)
                status, error = RequestStatus.FINISHED_ERROR, f"RoutingReplayError: {e}"
        if error is not None:
            status = RequestStatus.FINISHED_ERROR
            out.error = error
            out.routed_experts = None
        self.scheduler.release(req, status)

    def fail(self, req: Request, error: str) -> None:
        """The engine died: the request ends in error without touching the cache (its children are gone)."""
        out = self.output(req)
        req.status = RequestStatus.FINISHED_ERROR
        out.error, out.routed_experts = error, None

    def take_delta(self, req: Request) -> tuple[str, list[int]]:
        """The text and token ids produced since the previous call, for the caller to append."""
        out = self.output(req)
        n = out.num_returned_tokens if out.num_returned_tokens is not None else len(req.output_token_ids)
        token_ids = req.output_token_ids[out.num_sent_tokens : n]
        out.num_sent_tokens = max(out.num_sent_tokens, n)
        keep = 0
        if not req.is_finished and req.sampling_params.stop:
            keep = min(len(out.pending_text), max(len(s) for s in req.sampling_params.stop) - 1)
        cut = len(out.pending_text) - keep
        text, out.pending_text = out.pending_text[:cut], out.pending_text[cut:]
        return text, token_ids

    def _wants_r3(self, req: Request) -> bool:
        return self.routing is not None and req.sampling_params.return_routed_experts is not False

    def _gather_r3(self, req: Request, num_returned_tokens: int) -> np.ndarray:  # [rows, L, K]
        assert self.routing is not None
        kv = self.scheduler.kv
        start, end = row_range(req.num_prompt_tokens, num_returned_tokens, req.sampling_params.routed_experts_start)
        if req.num_computed_tokens < end:
            raise RoutingReplayError(
                f"request {req.request_id} has {req.num_computed_tokens} forwarded tokens but needs rows up to {end}"
            )
        t0 = time.perf_counter()
        rows = self.routing.gather(req.request_id, kv.block_table(req.request_id), kv.block_tags(req.request_id),
                                   start, end)
        self.r3.gather_seconds += time.perf_counter() - t0
        self.r3.rows_delivered += rows.shape[0]
        self.r3.bytes_delivered += rows.nbytes
        return rows


def _find_stop(text: str, stops: list[str], searched: int) -> tuple[int, str] | None:
    """Earliest stop string in `text`; text[:searched] was already searched, so a match must end after it."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, searched - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
