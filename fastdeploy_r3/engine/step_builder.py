"""What the workers are sent for a step (worker/messages.py): every step, each chunk's tokens,
positions and block table; once per request (the first time a worker sees it), what its sampler
keeps: sampling params and seed, the prompt when penalties or prompt logprobs need it, the ids
min_tokens holds back. Requests finished since the previous step are named once, so the workers
forget their sampling state.

A retry (a part of a failed step re-run by step_isolation.py) sends every request's once-only data
again, since the failed step may have ended before the workers took it, and no finished ids, which
the first attempt delivered.
"""

from __future__ import annotations

from collections.abc import Callable

from fastdeploy_r3.engine.request import Request
from fastdeploy_r3.engine.scheduler import ScheduledChunk
from fastdeploy_r3.worker.messages import PLACEHOLDER_TOKEN, ScheduledRequestData, StepInput


class StepBuilder:
    def __init__(
        self,
        block_table: Callable[[str], list[int]],
        block_tags: Callable[[str], list[int]],
        eos_token_ids: set[int],
    ) -> None:
        self.block_table = block_table
        self.block_tags = block_tags
        self.eos_token_ids = eos_token_ids
        self._step_id = 0
        self._worker_known: set[str] = set()  # requests whose once-only data the workers hold
        self._finished_since_step: list[str] = []

    def finished(self, request_id: str) -> None:
        """The request finished: the next step tells the workers to forget it."""
        self._finished_since_step.append(request_id)

    def build(self, chunks: list[ScheduledChunk], retry: bool) -> StepInput:
        self._step_id += 1
        finished: list[str] = []
        if not retry:
            # forgotten first (the worker forgets before it remembers): an id reused by a new request is new
            finished = [rid for rid in self._finished_since_step if rid in self._worker_known]
            self._worker_known.difference_update(finished)
            self._finished_since_step.clear()
        reqs = []
        for chunk in chunks:
            r = chunk.request
            start = chunk.start
            first = retry or r.request_id not in self._worker_known
            self._worker_known.add(r.request_id)
            data = ScheduledRequestData(
                request_id=r.request_id,
                token_ids=_chunk_tokens(r, start, start + chunk.num_new_tokens),
                start_pos=start,
                block_table=self.block_table(r.request_id),
                block_tags=self.block_tags(r.request_id),
                sample=chunk.samples,
                sampling_params=r.sampling_params if first else None,
                sampling_seed=r.sampling_params.seed if first else None,
            )
            if first:
                self._first_chunk_extras(data, r)
            reqs.append(data)
        return StepInput(self._step_id, reqs, finished)

    def _first_chunk_extras(self, data: ScheduledRequestData, r: Request) -> None:
        """What the worker's StepSampler needs beyond the chunk, sent once (worker/messages.py)."""
        p = r.sampling_params
        data.num_prompt_tokens = r.num_prompt_tokens
        if p.has_penalties or p.prompt_logprobs is not None:
            data.prompt_token_ids = r.prompt_token_ids
        if p.min_tokens > 0:
            eos = [] if p.ignore_eos else sorted(self.eos_token_ids)
            data.min_tokens_stop_ids = sorted(set(eos) | set(p.stop_token_ids))


def _chunk_tokens(r: Request, start: int, end: int) -> list[int]:
    """Token ids [start, end) of the request without copying the whole sequence; positions past its last
    token (a chunk scheduled ahead, engine/overlap.py) are PLACEHOLDER_TOKEN: the worker fills them in."""
    p, n = r.num_prompt_tokens, r.num_tokens
    known = min(end, n)
    if start >= p:
        ids = r.output_token_ids[start - p : known - p]
    elif known <= p:
        ids = r.prompt_token_ids[start:known]
    else:
        ids = r.prompt_token_ids[start:] + r.output_token_ids[: known - p]
    return ids + [PLACEHOLDER_TOKEN] * (end - max(known, start)) if end > n else ids
