"""Bisection of a failed step (issue 11, F1): only the chunk that makes a step fail fails."""

from __future__ import annotations

from fastdeploy_r3.engine.step_isolation import StepAttempt, run_isolating_failures
from fastdeploy_r3.worker.messages import WorkerError


class FakeWorker:
    """Fails any batch that holds a poisoned request id; otherwise samples [len(request id)]."""

    def __init__(self, poisoned: set[str]) -> None:
        self.poisoned = poisoned
        self.batches: list[tuple[list[str], bool]] = []

    def run(self, batch: list[str], retry: bool) -> StepAttempt:
        self.batches.append((list(batch), retry))
        bad = [rid for rid in batch if rid in self.poisoned]
        if bad:
            nan = WorkerError("RuntimeError", f"sampler got NaN probabilities (batch of {len(batch)})")
            return StepAttempt(error=nan)
        return StepAttempt(sampled={rid: [len(rid)] for rid in batch})


def test_a_healthy_step_runs_once() -> None:
    worker = FakeWorker(poisoned=set())
    step = run_isolating_failures(["a", "bb", "ccc"], worker.run)
    assert step.ok and step.sampled == {"a": [1], "bb": [2], "ccc": [3]}
    assert worker.batches == [(["a", "bb", "ccc"], False)]


def test_one_poisoned_request_of_four_fails_alone_and_the_rest_are_served() -> None:
    worker = FakeWorker(poisoned={"d"})
    step = run_isolating_failures(["a", "b", "c", "d"], worker.run)
    assert step.sampled == {"a": [1], "b": [1], "c": [1]}
    assert step.failed == [("d", WorkerError("RuntimeError", "sampler got NaN probabilities (batch of 1)"))]
    # whole batch, then [a b] ok, [c d] fails, then [c] ok, [d] fails
    assert worker.batches == [
        (["a", "b", "c", "d"], False), (["a", "b"], True), (["c", "d"], True), (["c"], True), (["d"], True),
    ]
    assert step.num_attempts == 5


def test_two_culprits_in_different_halves_each_fail_with_their_own_error() -> None:
    worker = FakeWorker(poisoned={"a", "e"})
    step = run_isolating_failures(["a", "b", "c", "d", "e"], worker.run)
    assert sorted(c for c, _ in step.failed) == ["a", "e"]
    assert step.sampled == {"b": [1], "c": [1], "d": [1]}


def test_a_worker_that_fails_every_step_fails_each_chunk_in_2n_minus_1_attempts() -> None:
    worker = FakeWorker(poisoned={"a", "b", "c"})
    step = run_isolating_failures(["a", "b", "c"], worker.run)
    assert [c for c, _ in step.failed] == ["a", "b", "c"]
    assert step.sampled == {} and step.num_attempts == 5


def test_a_transient_failure_of_the_whole_batch_serves_everything_from_the_halves() -> None:
    calls = {"n": 0}

    def flaky(batch: list[str], retry: bool) -> StepAttempt:
        calls["n"] += 1
        if not retry:
            return StepAttempt(error=WorkerError("RuntimeError", "transient"))
        return StepAttempt(sampled={rid: [0] for rid in batch})

    step = run_isolating_failures(["a", "b"], flaky)
    assert step.ok and step.sampled == {"a": [0], "b": [0]} and calls["n"] == 3


def test_an_empty_step_runs_nothing() -> None:
    worker = FakeWorker(poisoned=set())
    step = run_isolating_failures([], worker.run)
    assert step.ok and step.num_attempts == 0 and worker.batches == []
