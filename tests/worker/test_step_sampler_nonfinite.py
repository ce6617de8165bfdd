"""A request whose logits hold NaN or inf cannot be sampled: the step raises, naming it, before anything of
the step is counted, so the engine's bisection (engine/step_isolation.py) re-runs its neighbours as if it
had never been there."""

from __future__ import annotations

import pytest
import torch

from fastdeploy_r3.sampling_params import SamplingParams
from fastdeploy_r3.worker.input_batch import SampleRow
from fastdeploy_r3.worker.messages import ScheduledRequestData
from fastdeploy_r3.worker.sample.sampler import NonFiniteLogitsError, StepSampler

V = 8


def _data(rid: str, params: SamplingParams) -> ScheduledRequestData:
    return ScheduledRequestData(rid, [1, 2], 0, [0], [0], True, sampling_params=params, sampling_seed=7,
                                num_prompt_tokens=2, prompt_token_ids=[1, 2])


def _row(index: int, rid: str, params: SamplingParams) -> SampleRow:
    return SampleRow(index, _data(rid, params), 2)  # the prompt's last row draws position 2


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_row_of_non_finite_logits_fails_alone_and_counts_nothing(poison: float) -> None:
    sampler = StepSampler(V, torch.device("cpu"))
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=0)
    rows = [_row(0, "good", penalised), _row(1, "bad", SamplingParams(temperature=1.0))]
    for r in rows:
        sampler.remember(r.request)
    logits = torch.arange(2 * V, dtype=torch.float32).reshape(2, V)
    logits[1, 3] = poison
    with pytest.raises(NonFiniteLogitsError, match="request\\(s\\) bad;"):
        sampler.sample(logits.clone(), rows)
    assert int(sampler.stats.stack(["good"])[1].sum()) == 0  # the failed step counted no token
    sampled, records = sampler.sample(logits[:1].clone(), rows[:1])  # the re-run without it
    assert sampled == [V - 1] and records[0].token_id == V - 1
    assert int(sampler.stats.stack(["good"])[1].sum()) == 1


def test_a_row_with_every_token_masked_has_nothing_to_draw() -> None:
    sampler = StepSampler(V, torch.device("cpu"))
    row = _row(0, "masked", SamplingParams(temperature=0.0))
    sampler.remember(row.request)
    with pytest.raises(NonFiniteLogitsError, match="masked"):
        sampler.sample(torch.full((1, V), float("-inf")), [row])


def test_a_draw_found_bad_when_finished_later_takes_its_counts_back() -> None:
    """The worker launches a step's draw (sample_async, inside inference mode, as ModelRunner.launch) and
    finishes it later, after the next step may have been launched: the ids count for the penalties at
    once, and a row found without a distribution at the wait takes the whole step's counts back."""
    sampler = StepSampler(V, torch.device("cpu"))
    penalised = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    rows = [_row(0, "good", penalised), _row(1, "bad", SamplingParams(temperature=1.0))]
    logits = torch.arange(2 * V, dtype=torch.float32).reshape(2, V)
    logits[1, 3] = float("nan")
    with torch.inference_mode():
        for r in rows:
            sampler.remember(r.request)
        pending = sampler.sample_async(logits.clone(), rows)
        assert int(sampler.stats.stack(["good"])[1].sum()) == 1  # counted at launch: the next step sees it
    with pytest.raises(NonFiniteLogitsError, match="request\\(s\\) bad;"):
        pending.wait()  # outside inference mode, as a caller may be
    assert int(sampler.stats.stack(["good"])[1].sum()) == 0
    pending.discard()  # a second discard (ModelRunner.finish's) takes nothing more back
    assert int(sampler.stats.stack(["good"])[1].sum()) == 0 and sampler.last_ids is None
