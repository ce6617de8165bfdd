"""A model runner whose step raises when it feeds a request named "boom..." at position 9, as a kernel
rejecting one request's input would (imported by the spawned worker ranks, so a module of its own)."""

from __future__ import annotations

from fastdeploy_r3.worker.messages import StepInput, StepOutput
from fastdeploy_r3.worker.model_runner import ModelRunner

FAIL_POSITION = 9


class FailingRunner(ModelRunner):
    def execute(self, step: StepInput) -> StepOutput:
        for r in step.requests:
            if r.request_id.startswith("boom") and r.start_pos <= FAIL_POSITION < r.start_pos + len(r.token_ids):
                raise ValueError(f"{r.request_id} cannot be fed at position {FAIL_POSITION}")
        return super().execute(step)
