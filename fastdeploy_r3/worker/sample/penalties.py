"""What a request's history does to its next-token logits before sampling: penalties and min_tokens.

Shape legend: S = rows sampled this step, V = vocabulary.

    logits [S, V] float32 ──repetition──frequency──presence──min_tokens mask──► processed [S, V]

Semantics are vLLM's (and OpenAI's for the two additive ones):
- repetition_penalty r (1 = off) touches every token seen in the prompt or the output so far: a
  positive logit is divided by r, a negative one multiplied by r (CTRL's rule, as HF does it).
- frequency_penalty f: logit -= f * (times the token was generated so far).
- presence_penalty p: logit -= p if the token was generated at least once.
  Frequency and presence count OUTPUT tokens only; the prompt does not count.
- min_tokens m: while fewer than m tokens were generated, the stop tokens (EOS unless ignore_eos,
  and stop_token_ids) get -inf, so they cannot be sampled.

All of it runs as a few batched tensor ops on the logits' device; the per-request statistics live
on that device too (`TokenStats`), updated with the ids sampled each step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TokenStats:
    """Per request (only those with a penalty): prompt presence [V] bool and output counts [V] int32,
    on the device. The worker that samples owns them: it records every id it samples, so after a
    preemption (recompute) the counts are still those of the request's output."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._prompt: dict[str, torch.Tensor] = {}  # request id -> [V] bool
        self._counts: dict[str, torch.Tensor] = {}  # request id -> [V] int32

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._counts

    def add(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        ids = torch.tensor(list(prompt_token_ids), dtype=torch.int64, device=self.device)  # [P]
        mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)  # [V]
        mask[ids] = True
        self._prompt[request_id] = mask
        self._counts[request_id] = torch.zeros(self.vocab_size, dtype=torch.int32, device=self.device)

    def remove(self, request_id: str) -> None:
        self._prompt.pop(request_id, None)
        self._counts.pop(request_id, None)

    def record(self, request_ids: Sequence[str], token_ids: torch.Tensor, sign: int = 1) -> None:
        """token_ids [S] int64 on the device: the ids just sampled for request_ids (tracked ones count);
        sign -1 takes a failed step's ids back out."""
        if not self._counts:
            return
        step = torch.full((1,), sign, dtype=torch.int32, device=self.device)
        for row, rid in enumerate(request_ids):
            counts = self._counts.get(rid)
            if counts is not None:
                counts.index_add_(0, token_ids[row : row + 1], step)

    def stack(self, request_ids: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> prompt_mask [S, V] bool, output_counts [S, V] int32 (zeros for untracked rows)."""
        zeros_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
        zeros_counts = torch.zeros(self.vocab_size, dtype=torch.int32, device=self.device)
        mask = torch.stack([self._prompt.get(rid, zeros_mask) for rid in request_ids])  # [S, V]
        counts = torch.stack([self._counts.get(rid, zeros_counts) for rid in request_ids])  # [S, V]
        return mask, counts


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """logits [S, V] float32, prompt_mask [S, V] bool, output_counts [S, V] int, and per row
    repetition / frequency / presence [S] float32 -> new logits [S, V] (the input is not modified)."""
    seen = prompt_mask | (output_counts > 0)  # [S, V]
    rep = repetition[:, None].expand_as(logits)  # [S, V]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)  # [S, V]
    out = torch.where(seen, penalised, logits)  # [S, V]
    counts = output_counts.to(logits.dtype)  # [S, V]
    out = out - frequency[:, None] * counts
    return out - presence[:, None] * (counts > 0).to(logits.dtype)


def mask_tokens(logits: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
    """Set logits[rows[i], token_ids[i]] = -inf in place (min_tokens: stop tokens not yet allowed);
    logits [S, V]. Returns logits."""
    if rows:
        r = torch.tensor(list(rows), dtype=torch.int64, device=logits.device)  # [M]
        t = torch.tensor(list(token_ids), dtype=torch.int64, device=logits.device)  # [M]
        logits[r, t] = float("-inf")
    return logits
