"""StepSampler over several rows of one request (a verify step): each row draws what a one-token
step at the same position draws, so speculative decoding keeps a seeded request's tokens."""

from __future__ import annotations

import torch

from fastdeploy_r3.sampling_params import SamplingParams
from fastdeploy_r3.worker.input_batch import SampleRow
from fastdeploy_r3.worker.messages import ScheduledRequestData
from fastdeploy_r3.worker.sample.sampler import StepSampler

V = 32


def _sampler() -> StepSampler:
    s = StepSampler(V, device=torch.device("cpu"))
    first = ScheduledRequestData("r", [1, 2, 3], 0, [0], [1], sample=True,
                                 sampling_params=SamplingParams(temperature=0.8, seed=5, logprobs=1),
                                 sampling_seed=5, num_prompt_tokens=3)
    s.remember(first)
    return s


def test_three_rows_of_one_request_draw_what_three_one_token_steps_draw() -> None:
    """Logits of positions 4, 5, 6 sampled as three rows of one step and as three one-row steps:
    the same ids and the same logprob records, one per row, in row order."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))  # [3, V]
    chunk = ScheduledRequestData("r", [9, 8, 7], 3, [0, 1], [1, 2], sample=True, num_sample_rows=3)
    rows = [SampleRow(i, chunk, 4 + i) for i in range(3)]
    ids, records = _sampler().sample(logits.clone(), rows)
    alone = _sampler()
    one_by_one = []
    for i in range(3):  # the one-token step feeding position 3 + i, drawing 4 + i
        step = ScheduledRequestData("r", [chunk.token_ids[i]], 3 + i, [0, 1], [1, 2], sample=True)
        one_by_one.append(alone.sample(logits[i : i + 1].clone(), [SampleRow(0, step, 4 + i)]))
    assert ids == [got[0][0] for got in one_by_one]
    assert [records[i] for i in range(3)] == [got[1][0] for got in one_by_one]
