"""Which ranks launch a step before finishing the one before (worker_process.StepPipeline)."""

from __future__ import annotations

import pytest

from fastdeploy_r3.worker.model_runner import ModelRunner
from fastdeploy_r3.worker.worker_process import pipelines


class _OwnExecute(ModelRunner):
    def execute(self, step):  # noqa: ANN001, ANN201 - a runner whose steps do not split into launch and finish
        return super().execute(step)


def _runner(cls: type = ModelRunner, lookahead: int = 0) -> ModelRunner:
    runner = cls.__new__(cls)  # pipelines() reads the class and num_lookahead_tokens only
    runner.num_lookahead_tokens = lookahead
    return runner


def test_one_cuda_rank_of_a_plain_engine_pipelines_and_a_verifying_one_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain engine's decode steps may come before the previous one is answered (planned ahead); a
    verify step never does (the next drafts follow its tokens), so a rank verifying k = 3 drafts waits
    on each step's event instead of polling the pipe for a step that cannot come first."""
    monkeypatch.delenv("FDR3_PIPELINE_STEPS", raising=False)
    assert pipelines(_runner(), 1, "cuda")
    assert not pipelines(_runner(lookahead=3), 1, "cuda")
    assert not pipelines(_runner(), 2, "cuda")  # tensor parallelism: only rank 0 samples
    assert not pipelines(_runner(_OwnExecute), 1, "cuda")
    assert not pipelines(_runner(), 1, "cpu")  # a CPU launch computes the whole step
    monkeypatch.setenv("FDR3_PIPELINE_STEPS", "1")
    assert pipelines(_runner(), 1, "cpu") and not pipelines(_runner(lookahead=3), 1, "cpu")
