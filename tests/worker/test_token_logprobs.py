"""token_logprobs on a hand-made batch: chosen logprob, rank and top-N under the project's definition."""

from __future__ import annotations

import math

import torch

from fastdeploy_r3.worker.sample.logprobs import token_logprobs


def test_chosen_rank_and_top_of_two_rows_with_temperature() -> None:
    """Row 0 at T=2 picks token 1 of logits [2, 4, 0]: the distribution is softmax([1, 2, 0]), so
    logprob(1) = 2 - log(e + e^2 + 1), rank 1; row 1 greedy (T=0 counts as 1) picks token 0 of
    [0, ln 3, 0]: logprob log(1/5), rank 2."""
    logits = torch.tensor([[2.0, 4.0, 0.0], [0.0, math.log(3.0), 0.0]])
    res = token_logprobs(logits, torch.tensor([1, 0]), num_top=2, temperature=torch.tensor([2.0, 0.0]))
    out = res.to_host([2, 1])
    z = math.log(math.e + math.e**2 + 1)
    assert [o.token_id for o in out] == [1, 0] and [o.rank for o in out] == [1, 2]
    assert math.isclose(out[0].logprob, 2 - z, rel_tol=1e-6)
    assert math.isclose(out[1].logprob, math.log(1 / 5), rel_tol=1e-6)
    assert [t for t, _ in out[0].top] == [1, 0] and math.isclose(out[0].top[1][1], 1 - z, rel_tol=1e-6)
    assert [t for t, _ in out[1].top] == [1] and math.isclose(out[1].top[0][1], math.log(3 / 5), rel_tol=1e-6)


def test_no_temperature_is_log_softmax_and_zero_top_is_empty() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=gen)
    ids = torch.tensor([3, 17, 0, 49])
    out = token_logprobs(logits, ids, num_top=0).to_host([0] * 4)
    ref = torch.log_softmax(logits, dim=-1)[torch.arange(4), ids]
    assert all(o.top == [] for o in out)
    torch.testing.assert_close(torch.tensor([o.logprob for o in out]), ref)
    ranks = [(torch.log_softmax(logits[i], -1) > ref[i]).sum().item() + 1 for i in range(4)]
    assert [o.rank for o in out] == ranks
