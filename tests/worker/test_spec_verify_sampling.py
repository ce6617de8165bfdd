"""A sampled verify row (worker/sample/draw.py) draws as plain decoding does and keeps its draft when the
draw equals it: rejection sampling against the drafter's one-hot draft, in its simplest form.

One fixed 8-token distribution, 20,000 rows that differ only in their seed (fixed seeds: the test is
deterministic). Whatever the draft d (the most likely token, an unlikely one, one that top-k cuts
away), the rows' tokens pass a chi-square test against the target p, and d is kept p(d) of the time.
The control shows the chi-square test has the power to fail. The step sampler's verify rows are the
plain draws of the same (seed, position), so seeded speculation gives plain decoding's tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdeploy_r3.worker.sample.draw import SamplingBatch, sample_batch

V, N = 8, 20_000
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])  # p from 0.37 down to 0.01
SEEDS = list(range(1000, 1000 + N))
# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_CRIT = {2: 13.82, 3: 16.27, 6: 22.46, 7: 24.32}


def _draw(temperature: float = 1.0, top_k: int = 0, n: int = N, position: int = 17) -> np.ndarray:
    batch = SamplingBatch.build([temperature] * n, [top_k] * n, [1.0] * n, SEEDS[:n], [position] * n,
                                torch.device("cpu"))
    return sample_batch(LOGITS.expand(n, V).clone(), batch).numpy()


def _target(temperature: float = 1.0, top_k: int = 0) -> np.ndarray:
    scaled = LOGITS / temperature
    if top_k:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[-1], float("-inf"))
    return torch.softmax(scaled, -1).double().numpy()


def _chi2(ids: np.ndarray, p: np.ndarray) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the tokens p gives mass; a drawn token outside them fails."""
    counts = np.bincount(ids, minlength=V)
    support = p > 0
    assert counts[~support].sum() == 0, f"drew a token the target cannot give: {counts}"
    expected = p[support] * len(ids)
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


@pytest.mark.parametrize(("draft", "temperature", "top_k"), [
    (0, 1.0, 0),  # the most likely token: accepted ~37% of the time
    (6, 1.0, 0),  # an unlikely one
    (1, 0.7, 4),  # inside top-k, at another temperature
    (6, 0.7, 4),  # cut by top-k: p(d) = 0, never accepted
])
def test_verify_rows_keep_the_target_distribution_and_their_draft_p_of_d_of_the_time(
        draft: int, temperature: float, top_k: int) -> None:
    p = _target(temperature, top_k)
    ids = _draw(temperature, top_k)
    stat, dof = _chi2(ids, p)
    assert stat < CHI2_CRIT[dof], (stat, np.bincount(ids, minlength=V) / N, p)
    accepted = ids == draft  # the engine keeps a draft exactly when the row drew it
    assert abs(accepted.mean() - p[draft]) < 0.015
    # a rejected row's token is p's draw given it is not d: the residual max(p - onehot(d), 0), normalised
    if p[draft] > 0:
        residual = p.copy()
        residual[draft] = 0.0
        stat, dof = _chi2(ids[~accepted], residual / residual.sum())
        assert stat < CHI2_CRIT[dof]


def test_the_chi_square_test_has_the_power_to_fail() -> None:
    """Control: the same draws fail against the distribution at temperature 1.15 instead of 1, and a
    verifier that always kept its draft would fail by far."""
    stat, dof = _chi2(_draw(), _target(1.15))
    assert stat > CHI2_CRIT[dof]
    stat, dof = _chi2(np.zeros(N, dtype=np.int64), _target())
    assert stat > 100 * CHI2_CRIT[dof]


def test_the_step_sampler_s_verify_rows_are_plain_draws_of_the_same_seed_and_position() -> None:
    """A verify chunk [t, d] at positions 10, 11 samples two rows, 4,000 seeded requests: the first row
    (it decides on d) and the second (the bonus) draw exactly what plain decoding draws at positions 11
    and 12 with the same seeds, so seeded speculation gives plain decoding's tokens; d is kept p(d) of
    the time."""
    from fastdeploy_r3.sampling_params import SamplingParams
    from fastdeploy_r3.worker.input_batch import SampleRow
    from fastdeploy_r3.worker.messages import ScheduledRequestData
    from fastdeploy_r3.worker.sample.sampler import StepSampler

    n, d = 4000, 1
    sampler = StepSampler(V, torch.device("cpu"))
    rows = []
    for i in range(n):
        r = ScheduledRequestData(f"r{i}", [5, d], 10, [0, 1, 2], [1, 1, 1], sample=True, num_sample_rows=2,
                                 sampling_params=SamplingParams(temperature=1.0, max_tokens=8),
                                 sampling_seed=SEEDS[i], num_prompt_tokens=4)  # fmt: skip
        sampler.remember(r)
        rows += [SampleRow(2 * i, r, 11), SampleRow(2 * i + 1, r, 12)]
    ids = np.array(sampler.sample(LOGITS.expand(2 * n, V).clone(), rows)[0])
    verdicts, bonus = ids[0::2], ids[1::2]
    assert np.array_equal(verdicts, _draw(n=n, position=11))
    assert np.array_equal(bonus, _draw(n=n, position=12))
    assert abs((verdicts == d).mean() - _target()[d]) < 0.03
