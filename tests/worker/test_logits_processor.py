"""Penalties and min_tokens masking on a batch of logits rows, against hand-computed values and HF's
RepetitionPenaltyLogitsProcessor (an oracle nobody here wrote)."""

from __future__ import annotations

import math

import torch

from fastdeploy_r3.worker.sample.penalties import TokenStats, apply_penalties, mask_tokens

V = 6


def _stats(prompts: dict[str, list[int]], sampled: list[tuple[str, int]]) -> TokenStats:
    stats = TokenStats(V, torch.device("cpu"))
    for rid, prompt in prompts.items():
        stats.add(rid, prompt)
    for rid, tok in sampled:
        stats.record([rid], torch.tensor([tok]))
    return stats


def test_frequency_and_presence_count_output_tokens_only() -> None:
    """Prompt [0, 1], output [2, 2, 3]: frequency 0.5 and presence 1.0 lower 2 by 2.0 and 3 by 1.5;
    the prompt tokens 0 and 1 keep their logits."""
    stats = _stats({"a": [0, 1]}, [("a", 2), ("a", 2), ("a", 3)])
    mask, counts = stats.stack(["a"])
    assert counts[0].tolist() == [0, 0, 2, 1, 0, 0] and mask[0].tolist() == [True, True, False, False, False, False]
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    out = apply_penalties(logits, mask, counts, torch.tensor([1.0]), torch.tensor([0.5]), torch.tensor([1.0]))
    assert out.tolist() == [[1.0, 2.0, 1.0, 2.5, 5.0, 6.0]]
    assert logits.tolist() == [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]  # input untouched


def test_repetition_penalty_divides_positive_multiplies_negative_over_prompt_and_output() -> None:
    """r = 2 on prompt token 0 (logit 4 -> 2), prompt token 1 (-1 -> -2) and output token 4 (3 -> 1.5)."""
    stats = _stats({"a": [0, 1]}, [("a", 4)])
    mask, counts = stats.stack(["a"])
    logits = torch.tensor([[4.0, -1.0, 0.5, -3.0, 3.0, 0.0]])
    out = apply_penalties(logits, mask, counts, torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([0.0]))
    assert out.tolist() == [[2.0, -2.0, 0.5, -3.0, 1.5, 0.0]]


def test_repetition_penalty_equals_hf_processor_row_by_row() -> None:
    """Three rows with different penalties (one untracked row stays as is); HF's processor on each
    tracked row's prompt + output ids gives the same logits."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=gen)
    stats = _stats({"a": [0, 3], "b": [5]}, [("a", 1), ("b", 2), ("b", 2)])
    mask, counts = stats.stack(["a", "untracked", "b"])
    rep = torch.tensor([1.3, 1.0, 0.7])
    out = apply_penalties(logits, mask, counts, rep, torch.zeros(3), torch.zeros(3))
    for row, (ids, r) in {0: ([0, 3, 1], 1.3), 2: ([5, 2, 2], 0.7)}.items():
        ref = RepetitionPenaltyLogitsProcessor(r)(torch.tensor([ids]), logits[row : row + 1].clone())
        torch.testing.assert_close(out[row : row + 1], ref)
    assert torch.equal(out[1], logits[1])


def test_removed_request_is_untracked_and_mask_tokens_sets_minus_inf() -> None:
    stats = _stats({"a": [0]}, [])
    stats.remove("a")
    assert "a" not in stats
    logits = torch.zeros(2, V)
    mask_tokens(logits, [0, 1, 1], [5, 2, 5])
    assert [[i for i, x in enumerate(row) if math.isinf(x)] for row in logits.tolist()] == [[5], [2, 5]]
