"""When a worker step fails, find the requests that made it fail and serve the others.

A step runs the chunks of many requests in one batch, so one bad request (a kernel that rejects its
input, a sampler fed a NaN) makes the whole step raise. Failing every request of the step for one
culprit is what issue 11 (F1) calls "one request fails its neighbours". Instead the batch is split
in halves and each half re-run, recursively, until every failure is pinned on a single chunk:

    [a b c d] fails ─► [a b] ok            served
                       [c d] fails ─► [c] ok      served
                                      [d] fails   d fails alone, with the error of its own step

A batch that fails whole but whose halves both succeed (a transient fault) is served entirely. A
worker that fails every step costs 2n-1 attempts for n chunks and fails each chunk with its own
error. Re-running is safe: a failed step advanced no cursor and cached no block, and the KV slots
and R3 rows it may have written are written again by the re-run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from fastdeploy_r3.logprobs import TokenLogprob
from fastdeploy_r3.worker.messages import WorkerError

C = TypeVar("C")


@dataclass
class StepAttempt:
    """The outcome of one run of a batch: by request id, the tokens sampled (one or more), their logprob
    records and prompt logprobs (worker/messages.StepOutput's); or the worker's error."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    error: WorkerError | None = None
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # MTP drafts for the next step


@dataclass
class IsolatedStep(Generic[C]):
    """What a step produced once failures were isolated: the successful attempts' results, merged."""

    sampled: dict[str, list[int]]
    failed: list[tuple[C, WorkerError]]  # (chunk, error of the smallest batch that still failed: itself)
    num_attempts: int
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed


def run_isolating_failures(chunks: list[C], run: Callable[[list[C], bool], StepAttempt]) -> IsolatedStep[C]:
    """Run `chunks` as one step; on failure, bisect until each failure belongs to one chunk.

    `run(batch, retry)` runs one worker step over `batch`; `retry` is False only for the first,
    whole-batch attempt (the caller sends per-step bookkeeping such as finished request ids once).
    """
    done = StepAttempt()
    failed: list[tuple[C, WorkerError]] = []
    attempts = 0

    def attempt(batch: list[C], retry: bool) -> None:
        nonlocal attempts
        attempts += 1
        result = run(batch, retry)
        if result.error is None:
            done.sampled.update(result.sampled)
            done.logprobs.update(result.logprobs)
            done.prompt_logprobs.update(result.prompt_logprobs)
            done.draft_token_ids.update(result.draft_token_ids)
            return
        if len(batch) == 1:
            failed.append((batch[0], result.error))
            return
        mid = len(batch) // 2
        attempt(batch[:mid], True)
        attempt(batch[mid:], True)

    if chunks:
        attempt(list(chunks), False)
    return IsolatedStep(done.sampled, failed, attempts, done.logprobs, done.prompt_logprobs, done.draft_token_ids)
