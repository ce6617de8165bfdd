"""Sampling for a whole step in a few batched tensor ops, on whatever device holds the logits.

Shape legend: S = rows to sample this step (one per request that samples), V = vocabulary.

    logits [S, V] ──temperature──top-k──softmax──top-p──► probs [S, V] ──race against noise──► ids [S]

Greedy rows take the argmax of the raw logits (the first maximum, as torch.argmax picks it). The others use
the exponential race: argmax_v probs[v] / e[v] with e[v] ~ Exp(1) picks v with probability probs[v]. The
noise is a counter-based hash of (request seed, position of the sampled token, v), computed on the
device, so a seeded request draws the same tokens alone or in any batch, and no generator state lives
anywhere (a preempted request that recomputes draws the same noise again). Requests without a seed get
one drawn by the caller.

A verify row (a speculative draft d was fed at the position the row draws for, engine/speculative.py)
draws exactly as any row does, and its draft is accepted when the drawn id equals d. That is
rejection sampling against the drafter's point mass on d, in its simplest form: d is kept with
probability p(d), and a rejected row's id is p's draw conditioned on not being d, which is the
normalised residual max(p - q, 0); every id keeps probability p(v). Because the draw does not look at
the draft, a seeded request draws the very tokens of plain decoding whatever was drafted (n-gram or
MTP, a drafter state reset by a prefix hit or a preemption), and greedy rows are the argmax as always.

Only the sampled ids cross to the host, into a pinned buffer: one D2H copy and one host sync per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF
# odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 never overflows
_M1, _M2, _M3 = 0x2C1B3C6D, 0x297A2D39, 0x27D4EB2D


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche over int64 tensors holding values in [0, 2**32)."""
    h = ((h ^ (h >> 16)) * _M1) & _MASK32
    h = ((h ^ (h >> 15)) * _M2) & _MASK32
    h = ((h ^ (h >> 16)) * _M3) & _MASK32
    return h ^ (h >> 15)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seeds [S] int64 (any value), counters [S] int64 -> u [S, V] float32 in (0, 1), a pure function."""
    key = _mix32(seeds & _MASK32) ^ _mix32((seeds >> 32) & _MASK32 ^ 0x5BD1E995)  # [S]
    key = _mix32(key ^ _mix32(counters & _MASK32))  # [S]
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)  # [V]
    h = _mix32(key[:, None] ^ (vocab[None, :] * _M3 & _MASK32))  # [S, V]
    return (h >> 8).float().add_(0.5).mul_(1.0 / (1 << 24))  # 24 bits: exact in float32, never 0 or 1


@dataclass
class SamplingBatch:
    """Per-row parameters of one step, on the logits' device."""

    temperature: torch.Tensor  # [S] float32, 0 = greedy
    top_k: torch.Tensor  # [S] int64, 0 = off
    top_p: torch.Tensor  # [S] float32, 1 = off
    seeds: torch.Tensor  # [S] int64
    counters: torch.Tensor  # [S] int64 position of the token being sampled
    all_greedy: bool  # host-side: skip the sampling ops entirely
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def build(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        seeds: Sequence[int],
        counters: Sequence[int],
        device: torch.device,
    ) -> SamplingBatch:
        """From host lists (numpy-packed, then one copy to the device per dtype)."""
        floats = np.array([list(temperature), list(top_p)], dtype=np.float32)  # [2, S]
        ints = np.array([[max(k, 0) for k in top_k], list(seeds), list(counters)], dtype=np.int64)  # [3, S]
        f = torch.from_numpy(floats).to(device, non_blocking=True)
        i = torch.from_numpy(ints).to(device, non_blocking=True)
        return cls(
            temperature=f[0], top_p=f[1], top_k=i[0], seeds=i[1], counters=i[2],
            all_greedy=bool((floats[0] == 0).all()),
            any_top_k=bool(ints[0].any()),
            any_top_p=bool((floats[1] < 1).any()),
        )


def truncate(scaled: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scaled logits [S, V] (after temperature) -> the distribution the draw uses, most likely first:
    sorted_probs [S, V] (0 where truncated), order [S, V] (the vocabulary id of each sorted entry) and
    keep [S, V] bool. Kept entries form a prefix of each row, so row i keeps order[i, :keep[i].sum()]."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [S, V]
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)  # [S, V]
    if batch.any_top_k:
        # keep logits >= the k-th largest (ties at the k-th kept); k = 0 keeps all
        k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=vocab), vocab)  # [S]
        kth = sorted_logits.gather(1, (k - 1)[:, None])  # [S, 1]
        keep = sorted_logits >= kth
        sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [S, V]
    if batch.any_top_p:
        # the smallest prefix whose mass reaches top_p (always the top token)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [S, V] mass ranked above each
        keep = keep & (before < batch.top_p[:, None])
        sorted_probs = sorted_probs.masked_fill(~keep, 0.0)
    return sorted_probs, order, keep


def sample_batch(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [S, V] float32 -> sampled ids [S] int64, on the logits' device (no host sync)."""
    greedy_ids = logits.argmax(dim=-1)  # [S]
    if batch.all_greedy:
        return greedy_ids
    vocab = logits.shape[1]
    greedy = batch.temperature == 0  # [S]
    temp = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)  # [S]
    scaled = logits / temp[:, None]  # [S, V]
    if batch.any_top_k or batch.any_top_p:
        sorted_probs, order, _ = truncate(scaled, batch)  # [S, V] each
        probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)  # [S, V]
    else:
        probs = torch.softmax(scaled, dim=-1)  # [S, V]
    noise = -torch.log(uniform_noise(batch.seeds, batch.counters, vocab))  # [S, V] Exp(1)
    sampled = (probs / noise).argmax(dim=-1)  # [S]
    return torch.where(greedy, greedy_ids, sampled)


class HostCopy:
    """Device tensors on their way to host memory, without waiting: one non-blocking copy each and one
    event after them. A step finished later (worker_process.py launches the next one first) keeps its
    own copies, so two steps in flight never share a host buffer. On the CPU there is nothing to wait for."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.event: torch.cuda.Event | None = None
        if any(t.is_cuda for t in tensors):
            # non_blocking device-to-host copies land in pinned memory (torch allocates it so)
            self.host = [t.to("cpu", non_blocking=True) for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = list(tensors)

    def done(self) -> bool:
        """Whether the copies landed (never waits)."""
        return self.event is None or self.event.query()

    def wait(self) -> list[torch.Tensor]:
        """The host tensors, once the copies (and everything the stream ran before them) are done."""
        if self.event is not None:
            self.event.synchronize()
        return self.host
