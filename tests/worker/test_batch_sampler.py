"""The batched sampler on the CPU: greedy equals the argmax, filters restrict the support exactly,
seeded draws are a pure function of (seed, position), and the draw follows the distribution."""

from __future__ import annotations

import torch

from fastdeploy_r3.worker.sample.draw import SamplingBatch, sample_batch, uniform_noise

CPU = torch.device("cpu")


def batch(n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seeds: list[int] | None = None,
          counters: list[int] | None = None) -> SamplingBatch:  # fmt: skip
    return SamplingBatch.build([temperature] * n, [top_k] * n, [top_p] * n, seeds or [0] * n,
                               counters or list(range(n)), CPU)


def test_greedy_rows_equal_sample_token() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    got = sample_batch(logits, batch(6, temperature=0.0)).tolist()
    assert got == logits.argmax(dim=-1).tolist()


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    """Rows 0 and 2 greedy, row 1 sampled at temperature 1: rows 0 and 2 are their argmax."""
    logits = torch.tensor([[0.0, 5.0, 1.0], [1.0, 1.0, 1.0], [9.0, 0.0, 0.0]])
    b = SamplingBatch.build([0.0, 1.0, 0.0], [0, 0, 0], [1.0, 1.0, 1.0], [1, 2, 3], [10, 10, 10], CPU)
    ids = sample_batch(logits, b).tolist()
    assert ids[0] == 1 and ids[2] == 0 and ids[1] in (0, 1, 2)


def test_top_k_and_top_p_restrict_the_support() -> None:
    """probs 0.5/0.3/0.15/0.05: over 400 positions top_k=2 and top_p=0.7 draw only tokens 0 and 1, both."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(400, 4).contiguous()
    for b in (batch(400, top_k=2), batch(400, top_p=0.7)):
        assert set(sample_batch(logits, b).tolist()) == {0, 1}
    assert set(sample_batch(logits, batch(400, top_p=0.5)).tolist()) == {0}  # 0.5 alone reaches 0.5


def test_top_k_1_is_greedy_at_any_temperature() -> None:
    torch.manual_seed(3)
    logits = torch.randn(8, 40)
    assert torch.equal(sample_batch(logits, batch(8, temperature=1.7, top_k=1)), logits.argmax(-1))


def test_seeded_draws_depend_on_seed_and_position_only() -> None:
    """Row (seed 7, position 12) draws the same token alone and inside a batch of 5 other rows."""
    torch.manual_seed(4)
    logits = torch.randn(6, 100)
    alone = sample_batch(logits[3:4], batch(1, seeds=[7], counters=[12])).item()
    mixed = sample_batch(logits, batch(6, seeds=[1, 2, 3, 7, 5, 6], counters=[12, 3, 4, 12, 9, 9]))
    assert mixed[3].item() == alone
    again = sample_batch(logits, batch(6, seeds=[1, 2, 3, 7, 5, 6], counters=[12, 3, 4, 12, 9, 9]))
    assert torch.equal(mixed, again)


def test_draw_frequencies_follow_the_probabilities() -> None:
    """4000 positions of one seed over probs 0.6/0.3/0.1: frequencies within 0.03 of them."""
    probs = torch.tensor([0.6, 0.3, 0.1])
    ids = sample_batch(probs.log().expand(4000, 3).contiguous(), batch(4000, seeds=[11] * 4000))
    freq = torch.bincount(ids, minlength=3).float() / 4000
    assert (freq - probs).abs().max().item() < 0.03, freq.tolist()


def test_noise_is_uniform_in_the_open_interval_and_seed_sensitive() -> None:
    u = uniform_noise(torch.tensor([5, 6]), torch.tensor([0, 0]), 20000)  # [2, V]
    assert 0.0 < u.min().item() and u.max().item() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.01
    assert (u[0] != u[1]).float().mean().item() > 0.99
    assert torch.equal(u, uniform_noise(torch.tensor([5, 6]), torch.tensor([0, 0]), 20000))
