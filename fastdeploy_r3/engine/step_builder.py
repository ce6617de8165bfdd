"""What the workers are sent for a step (worker/messages.py), in proportion to what changed:

  - every step, each chunk's tokens and positions (a chunk scheduled ahead: a placeholder, overlap.py),
    and the speculative drafts after a sampling chunk (speculative.py), each of them sampling;
  - a request's block table whole the first time the workers see it, after it was preempted (its
    blocks were freed and it got new ones), on a retry and after a failed step; otherwise only the
    blocks appended since the previous step (worker/batch_state.py keeps the tables);
  - once per request, what its sampler keeps: sampling params and seed, the prompt when penalties or
    prompt logprobs need it, the ids min_tokens holds back;
  - requests finished since the previous step, named once, so the workers forget them.

A retry (a part of a failed step re-run by step_isolation.py) sends every request's state whole again,
since the failed step may have ended before the workers took it, and no finished ids, which the first
attempt delivered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from fastdeploy_r3.engine.request import Request
from fastdeploy_r3.engine.scheduler import ScheduledChunk
from fastdeploy_r3.worker.messages import PLACEHOLDER_TOKEN, ScheduledRequestData, StepInput


class StepBuilder:
    def __init__(
        self,
        blocks_since: Callable[[str, int], tuple[list[int], list[int]]],
        eos_token_ids: set[int],
        diff: bool = True,
    ) -> None:
        """blocks_since(request id, start): block ids and tags from index start on (PrefixCacheManager's);
        diff=False sends every block table whole every step (the reference the diffs must reproduce)."""
        self.blocks_since = blocks_since
        self.eos_token_ids = eos_token_ids
        self.diff = diff
        self._step_id = 0
        self._worker_known: set[str] = set()  # requests whose once-only data the workers hold
        # request id -> (blocks the workers hold, its num_preemptions when they were sent)
        self._worker_blocks: dict[str, tuple[int, int]] = {}
        self._finished_since_step: list[str] = []

    def finished(self, request_id: str) -> None:
        """The request finished: the next step tells the workers to forget it."""
        self._finished_since_step.append(request_id)

    def resend_whole(self, request_ids: Iterable[str]) -> None:
        """A step with these requests failed, maybe before the workers applied its diffs: their next
        chunks carry the whole block table."""
        for rid in request_ids:
            self._worker_blocks.pop(rid, None)

    def build(self, chunks: list[ScheduledChunk], retry: bool) -> StepInput:
        self._step_id += 1
        finished: list[str] = []
        if not retry:
            # forgotten first (the worker forgets before it remembers): an id reused by a new request is new
            finished = [rid for rid in self._finished_since_step if rid in self._worker_known]
            self._worker_known.difference_update(finished)
            for rid in self._finished_since_step:
                self._worker_blocks.pop(rid, None)
            self._finished_since_step.clear()
        reqs = []
        for chunk in chunks:
            r = chunk.request
            rid, start = r.request_id, chunk.start
            first = retry or rid not in self._worker_known
            self._worker_known.add(rid)
            held, preemptions = self._worker_blocks.get(rid, (0, -1))
            blocks_from = held if self.diff and not first and preemptions == r.num_preemptions else 0
            block_ids, tags = self.blocks_since(rid, blocks_from)
            self._worker_blocks[rid] = (blocks_from + len(block_ids), r.num_preemptions)
            data = ScheduledRequestData(
                request_id=rid,
                # a verify step feeds the drafts after the chunk; each of them and the chunk's last token samples
                token_ids=_chunk_tokens(r, start, start + chunk.num_new_tokens) + chunk.drafts,
                start_pos=start,
                block_table=block_ids,
                block_tags=tags,
                sample=chunk.samples,
                num_sample_rows=len(chunk.drafts) + 1,
                blocks_from=blocks_from,
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
