"""Log-probabilities of sampled and prompt tokens, on the device in float32 (definition: logprobs.py).

Shape legend: S = rows, V = vocabulary, N = top alternatives asked for (the largest of the rows).

    processed logits [S, V] ─ / T ─ log_softmax ─► lp [S, V] ─► chosen [S], rank [S], top [S, N]

Only `chosen`, `rank` and the top-N ids and values leave the device, in one copy each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastdeploy_r3.logprobs import TokenLogprob


@dataclass
class LogprobTensors:
    """Device results for S rows; `to_host` turns them into one TokenLogprob per row."""

    token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor  # [S] float32
    ranks: torch.Tensor  # [S] int64, 1 = most likely
    top_ids: torch.Tensor  # [S, N] int64
    top_logprobs: torch.Tensor  # [S, N] float32

    def to_host(self, num_top: Sequence[int]) -> list[TokenLogprob]:
        """num_top[i]: how many alternatives row i asked for (<= N)."""
        ids = self.token_ids.cpu().tolist()
        lps = self.logprobs.cpu().tolist()
        ranks = self.ranks.cpu().tolist()
        top_ids = self.top_ids.cpu().tolist()
        top_lps = self.top_logprobs.cpu().tolist()
        return [
            TokenLogprob(ids[i], lps[i], ranks[i], list(zip(top_ids[i][: num_top[i]], top_lps[i][: num_top[i]])))
            for i in range(len(ids))
        ]


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int, temperature: torch.Tensor | None = None
) -> LogprobTensors:
    """logits [S, V] (float32 or wider), token_ids [S] int64, temperature [S] float32 or None (= 1;
    0 counts as 1, the greedy rows' distribution is the unscaled one) -> LogprobTensors on the device."""
    logits = logits.float()
    if temperature is not None:
        t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))  # [S]
        logits = logits / t[:, None]
    lp = torch.log_softmax(logits, dim=-1)  # [S, V]
    chosen = lp.gather(1, token_ids[:, None])  # [S, 1]
    ranks = (lp > chosen).sum(dim=-1) + 1  # [S]
    n = min(num_top, lp.shape[-1])
    top_lp, top_ids = lp.topk(n, dim=-1) if n > 0 else (lp[:, :0], token_ids[:, None][:, :0])  # [S, N]
    return LogprobTensors(token_ids, chosen[:, 0], ranks, top_ids, top_lp)
