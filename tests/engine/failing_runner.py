"""A model runner whose step fails for a request named "boom..." or "late..." at position 9 (imported by
the spawned worker ranks, so a module of its own):

- "boom": the step feeding position 9 raises while it is launched, as a kernel rejecting one request's
  input would;
- "late": the step feeding position 9 draws no token for it, as non-finite logits would, and the step
  fails when it is finished, after the worker may have launched the next step (worker_process.py).
"""

from __future__ import annotations

import torch

from fastdeploy_r3.worker.messages import StepInput
from fastdeploy_r3.worker.model_runner import LaunchedStep, ModelRunner

FAIL_POSITION = 9


def _feeds(r, prefix: str) -> bool:  # noqa: ANN001 - a ScheduledRequestData
    return r.request_id.startswith(prefix) and r.start_pos <= FAIL_POSITION < r.start_pos + len(r.token_ids)


class FailingRunner(ModelRunner):
    def launch(self, step: StepInput) -> LaunchedStep:
        for r in step.requests:
            if _feeds(r, "boom"):
                raise ValueError(f"{r.request_id} cannot be fed at position {FAIL_POSITION}")
        launched = super().launch(step)
        late = [i for i, row in enumerate(launched.sample_rows) if _feeds(row.request, "late")]
        if late and launched.pending is not None:
            # the draw's "no distribution" mark (sampler.py), as NaN logits leave it: CPU tensors only
            with torch.inference_mode():
                launched.pending.host.host[0][late] = -1
        return launched
