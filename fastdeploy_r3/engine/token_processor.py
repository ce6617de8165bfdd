"""Turns sampled tokens into request progress: append, detokenize incrementally, stop checks, and at
finish gather R3 (before the blocks are freed), then free; `take_delta` hands out what is new.

Text for the caller is sent as deltas: each step's new characters, minus the last (longest stop
string - 1) characters while the request runs, since a stop string beginning there would cut them.

    finish → gather R3 rows [start, P + N - 1) through the block table → Scheduler.release (free blocks)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastdeploy_r3.cache_manager.routing_cache_manager import RoutingCacheManager
from fastdeploy_r3.engine.detokenizer import IncrementalDetokenizer
from fastdeploy_r3.engine.request import Request, RequestStatus
from fastdeploy_r3.engine.scheduler import Scheduler
from fastdeploy_r3.logprobs import TokenLogprob
from fastdeploy_r3.r3.errors import RoutingReplayError
from fastdeploy_r3.r3.layouts import row_range


@dataclass
class R3Counters:
    rows_delivered: int = 0
    bytes_delivered: int = 0
    failures: int = 0
    gather_seconds: float = 0.0


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

    def append_token(self, req: Request, token_id: int, logprob: TokenLogprob | None = None) -> None:
        """Record a sampled token (and its logprob record, when the request asked for logprobs) and
        finish the request if it stops here. Before min_tokens tokens nothing but the length stops it."""
        req.output_token_ids.append(token_id)
        if req.output_logprobs is not None:
            if logprob is None:  # never expected; fail this request, not the engine
                self.finish(req, RequestStatus.FINISHED_ERROR,
                            error=f"request {req.request_id} asked for logprobs but the worker sent none")
                return
            req.output_logprobs.append(logprob)
        params = req.sampling_params
        may_stop = len(req.output_token_ids) >= params.min_tokens
        status: RequestStatus | None = None
        if may_stop and token_id in params.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
        elif may_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        at_length = len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.max_model_len
        if self.tokenizer is not None:
            if req.detokenizer is None:
                req.detokenizer = IncrementalDetokenizer(
                    _Decoding(self.tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens))
            if status is not None and not params.include_stop_str_in_output:
                # the stop token's own text is trimmed, as vLLM does and SGLang unless no_stop_trim
                # (it stays in token_ids)
                new_text = req.detokenizer.flush()
            else:
                new_text = req.detokenizer.push([token_id])
                if status is not None or at_length:
                    new_text += req.detokenizer.flush()
            searched = len(req.pending_text)
            req.pending_text += new_text
            if params.stop and status is None and new_text and may_stop:
                cut = _find_stop(req.pending_text, params.stop, searched)
                if cut is not None:
                    end = cut[0] + len(cut[1]) if params.include_stop_str_in_output else cut[0]
                    req.pending_text = req.pending_text[:end]
                    req.stop_reason = cut[1]
                    status = RequestStatus.FINISHED_STOPPED
        if status is None and at_length:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.finish(req, status)

    def finish(self, req: Request, status: RequestStatus, error: str | None = None) -> None:
        """Gather R3 (if wanted), then give the blocks back."""
        if req.num_returned_tokens is None:
            req.num_returned_tokens = len(req.output_token_ids)
        if error is None and status is not RequestStatus.FINISHED_ABORTED and self._wants_r3(req):
            try:
                req.routed_experts = self._gather_r3(req)
            except RoutingReplayError as e:
                self.r3.failures += 1
                # fail closed for this request, and let the next one recompute instead of failing too
                self.scheduler.kv.forget_cached(req.request_id)
                status, error = RequestStatus.FINISHED_ERROR, f"RoutingReplayError: {e}"
        if error is not None:
            status = RequestStatus.FINISHED_ERROR
            req.error = error
            req.routed_experts = None
        self.scheduler.release(req, status)

    def take_delta(self, req: Request) -> tuple[str, list[int]]:
        """The text and token ids produced since the previous call, for the caller to append."""
        n = req.num_returned_tokens if req.num_returned_tokens is not None else len(req.output_token_ids)
        token_ids = req.output_token_ids[req.num_sent_tokens : n]
        req.num_sent_tokens = max(req.num_sent_tokens, n)
        keep = 0
        if not req.is_finished and req.sampling_params.stop:
            keep = min(len(req.pending_text), max(len(s) for s in req.sampling_params.stop) - 1)
        cut = len(req.pending_text) - keep
        text, req.pending_text = req.pending_text[:cut], req.pending_text[cut:]
        return text, token_ids

    def _wants_r3(self, req: Request) -> bool:
        return self.routing is not None and req.sampling_params.return_routed_experts is not False

    def _gather_r3(self, req: Request):  # -> np.ndarray [rows, L, K]
        assert self.routing is not None
        kv = self.scheduler.kv
        start, end = row_range(req.num_prompt_tokens, req.num_returned_tokens or 0,
                               req.sampling_params.routed_experts_start)
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


class _Decoding:
    """The tokenizer's decode with the request's skip_special_tokens and spaces_between_special_tokens
    (what IncrementalDetokenizer calls)."""

    def __init__(self, tokenizer: object, skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.kwargs = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:  # the default needs no keyword: any decode(ids, skip_...) works
            self.kwargs["spaces_between_special_tokens"] = False

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, **self.kwargs)  # type: ignore[attr-defined]


def _find_stop(text: str, stops: list[str], searched: int) -> tuple[int, str] | None:
    """Earliest stop string in `text`; text[:searched] was already searched, so a match must end after it."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, searched - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
