"""Log-probabilities of sampled and prompt tokens, on the device in float32 (definition: logprobs.py).

Shape legend: S = rows, V = vocabulary, N = top alternatives asked for (the largest of the rows),
M = the most ids a row's truncation kept.

    processed logits [S, V] ─ / T ─ log_softmax ─► lp [S, V] ─► chosen [S], rank [S], top [S, N]
                                                            ├─► entropy [S]               (asked for)
                        truncate (draw.py)          ─► keep ─► kept ids [S, M], chosen renormalised [S]

Only `chosen`, `rank`, the top-N ids and values and the extras asked for leave the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from fastdeploy_r3.logprobs import TokenLogprob
from fastdeploy_r3.worker.sample.draw import SamplingBatch, truncate


@dataclass
class LogprobTensors:
    """Device results for S rows; `to_host` turns them into one TokenLogprob per row."""

    token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor  # [S] float32
    ranks: torch.Tensor  # [S] int64, 1 = most likely
    top_ids: torch.Tensor  # [S, N] int64
    top_logprobs: torch.Tensor  # [S, N] float32
    entropy: torch.Tensor | None = None  # [S] float32
    kept_counts: torch.Tensor | None = None  # [S] int64
    kept_ids: torch.Tensor | None = None  # [S, M] int64, row i's first kept_counts[i] are kept
    kept_logprobs: torch.Tensor | None = None  # [S] float32, chosen renormalised over the kept ids

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held, in field order (those not asked for are None and left out)."""
        return [t for f in fields(self) if (t := getattr(self, f.name)) is not None]

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> LogprobTensors:
        """The same record with `tensors()` replaced in order (their host copies, say)."""
        names = [f.name for f in fields(self) if getattr(self, f.name) is not None]
        return replace(self, **dict(zip(names, tensors, strict=True)))

    def to_host(self, num_top: Sequence[int], entropy: Sequence[bool] | None = None,
                kept: Sequence[bool] | None = None) -> list[TokenLogprob]:
        """num_top[i]: how many alternatives row i asked for (<= N); entropy[i] / kept[i]: whether
        row i asked for its entropy / its kept ids (renormalised logprob)."""
        ids = self.token_ids.cpu().tolist()
        lps = self.logprobs.cpu().tolist()
        ranks = self.ranks.cpu().tolist()
        top_ids = self.top_ids.cpu().tolist()
        top_lps = self.top_logprobs.cpu().tolist()
        ent = self.entropy.cpu().tolist() if self.entropy is not None else None
        counts = self.kept_counts.cpu().tolist() if self.kept_counts is not None else None
        kept_ids = self.kept_ids.cpu().tolist() if self.kept_ids is not None else None
        kept_lps = self.kept_logprobs.cpu().tolist() if self.kept_logprobs is not None else None
        out = []
        for i in range(len(ids)):
            rec = TokenLogprob(ids[i], lps[i], ranks[i], list(zip(top_ids[i][: num_top[i]], top_lps[i][: num_top[i]])))
            if ent is not None and entropy is not None and entropy[i]:
                rec.entropy = ent[i]
            if kept_ids is not None and counts is not None and kept_lps is not None and kept is not None and kept[i]:
                rec.kept_ids = kept_ids[i][: counts[i]]
                rec.logprob = kept_lps[i]
            out.append(rec)
        return out


def token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    num_top: int,
    temperature: torch.Tensor | None = None,
    entropy: bool = False,
    truncation: SamplingBatch | None = None,
) -> LogprobTensors:
    """logits [S, V] (float32 or wider), token_ids [S] int64, temperature [S] float32 or None (= 1;
    0 counts as 1, the greedy rows' distribution is the unscaled one) -> LogprobTensors on the device.
    entropy: also each row's entropy; truncation (the rows' sampling parameters): also the ids the
    draw's top-k / top-p kept (greedy rows: the token alone) and the chosen logprob renormalised
    over them."""
    logits = logits.float()
    if temperature is not None:
        t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))  # [S]
        logits = logits / t[:, None]
    lp = torch.log_softmax(logits, dim=-1)  # [S, V]
    chosen = lp.gather(1, token_ids[:, None])  # [S, 1]
    ranks = (lp > chosen).sum(dim=-1) + 1  # [S]
    n = min(num_top, lp.shape[-1])
    top_lp, top_ids = lp.topk(n, dim=-1) if n > 0 else (lp[:, :0], token_ids[:, None][:, :0])  # [S, N]
    out = LogprobTensors(token_ids, chosen[:, 0], ranks, top_ids, top_lp)
    if entropy:
        out.entropy = torch.special.entr(lp.exp()).sum(dim=-1)  # [S]; entr(0) = 0 where lp = -inf
    if truncation is not None:
        _, order, keep = truncate(logits, truncation)  # [S, V] each, most likely first
        greedy = truncation.temperature == 0  # [S]
        counts = torch.where(greedy, 1, keep.sum(dim=-1))  # [S]
        width = int(counts.max().item()) if counts.numel() else 0
        ids = order[:, :width].clone()  # [S, M]
        ids[:, 0] = torch.where(greedy, token_ids, ids[:, 0])  # greedy: the argmax torch picked, ties included
        kept_lp = lp.gather(1, order).masked_fill(~keep, float("-inf"))  # [S, V]
        renormalised = chosen[:, 0] - torch.logsumexp(kept_lp, dim=-1)  # [S]
        out.kept_counts, out.kept_ids = counts, ids
        out.kept_logprobs = torch.where(greedy, torch.zeros_like(renormalised), renormalised)
    return out
