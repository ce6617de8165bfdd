"""Rejection sampling of a verify row (worker/sample/draw.py) keeps the target distribution exact.

One fixed 8-token distribution, 20,000 rows that differ only in their seed (fixed seeds: the test is
deterministic). A verify row with draft d draws d with probability p(d), else a token of p with d
removed; its histogram must pass a chi-square test against p itself, whatever d is: the most likely
token, an unlikely one, one that top-k cuts away. The control shows the test has the power to fail:
a slightly different temperature, or a verifier that always keeps its draft, fails it.
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
CHI2_CRIT = {3: 16.27, 7: 24.32}


def _draw(drafts: list[int] | None, temperature: float = 1.0, top_k: int = 0) -> np.ndarray:
    batch = SamplingBatch.build([temperature] * N, [top_k] * N, [1.0] * N, SEEDS, [17] * N, torch.device("cpu"),
                                drafts=drafts)
    return sample_batch(LOGITS.expand(N, V).clone(), batch).numpy()


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
    (6, 0.7, 4),  # cut by top-k: p(d) = 0, always rejected
])
def test_a_verify_row_draws_the_target_distribution(draft: int, temperature: float, top_k: int) -> None:
    p = _target(temperature, top_k)
    ids = _draw([draft] * N, temperature, top_k)
    stat, dof = _chi2(ids, p)
    assert stat < CHI2_CRIT[dof], (stat, np.bincount(ids, minlength=V) / N, p)
    # and the draft is kept about p(d) of the time (the rows equal to d are the accepted ones)
    assert abs((ids == draft).mean() - p[draft]) < 0.015


def test_the_chi_square_test_has_the_power_to_fail() -> None:
    """Control: the same verified draws fail against the distribution at temperature 1.15 instead of 1,
    and a verifier that always keeps its draft fails by far."""
    ids = _draw([0] * N)
    stat, dof = _chi2(ids, _target(1.15))
    assert stat > CHI2_CRIT[dof]
    stat, dof = _chi2(np.zeros(N, dtype=np.int64), _target())
    assert stat > 100 * CHI2_CRIT[dof]


def test_plain_rows_are_untouched_and_greedy_rows_take_the_argmax() -> None:
    """Rows without a draft (-1) draw exactly what a batch without drafts draws; greedy rows ignore drafts."""
    mixed = [-1 if i % 2 else 3 for i in range(N)]
    with_drafts, without = _draw(mixed), _draw(None)
    assert np.array_equal(with_drafts[1::2], without[1::2])
    assert not np.array_equal(with_drafts[::2], without[::2])
    greedy = SamplingBatch.build([0.0] * 4, [0] * 4, [1.0] * 4, [1] * 4, [5] * 4, torch.device("cpu"), drafts=[3] * 4)
    assert sample_batch(LOGITS.expand(4, V).clone(), greedy).tolist() == [0] * 4


def test_the_same_seeds_draw_the_same_verdicts() -> None:
    assert np.array_equal(_draw([2] * N), _draw([2] * N))


def test_the_step_sampler_reads_each_row_s_draft_from_its_chunk() -> None:
    """A verify chunk [t, d] at positions 10, 11 samples two rows: the first decides on d (the token fed at
    position 11, the one it draws for), the second is the bonus, an ordinary draw. 4,000 seeded requests."""
    from fastdeploy_r3.sampling_params import SamplingParams
    from fastdeploy_r3.worker.input_batch import SampleRow
    from fastdeploy_r3.worker.messages import ScheduledRequestData
    from fastdeploy_r3.worker.sample.sampler import StepSampler

    n, d = 4000, 1
    sampler = StepSampler(V, torch.device("cpu"))
    rows = []
    for i in range(n):
        r = ScheduledRequestData(f"r{i}", [5, d], 10, [0, 1, 2], [1, 1, 1], sample=True, num_sample_rows=2,
                                 sampling_params=SamplingParams(temperature=1.0, max_tokens=8), sampling_seed=i,
                                 num_prompt_tokens=4)  # fmt: skip
        sampler.remember(r)
        rows += [SampleRow(2 * i, r, 11), SampleRow(2 * i + 1, r, 12)]
    ids = np.array(sampler.sample(LOGITS.expand(2 * n, V).clone(), rows)[0])
    p = _target()
    verdicts, bonus = ids[0::2], ids[1::2]
    for drawn in (verdicts, bonus):
        stat, dof = _chi2(drawn, p)
        assert stat < CHI2_CRIT[dof]
    assert abs((verdicts == d).mean() - p[d]) < 0.03
    # the first row really was a verify row: its draws differ from plain draws of the same (seed, position)
    plain = SamplingBatch.build([1.0] * n, [0] * n, [1.0] * n, list(range(n)), [11] * n, torch.device("cpu"))
    assert not np.array_equal(verdicts, sample_batch(LOGITS.expand(n, V).clone(), plain).numpy())
