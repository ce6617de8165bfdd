"""The worker's sampling state per request and one step's sampling pipeline.

Shape legend: S = rows that sample this step, V = vocabulary, Q = prompt positions scored this step.

    logits [S, V] float32
      └─ penalties (rows with any) ─ min_tokens mask (rows still short) ─► processed [S, V]
           ├─ draw one id per row (draw.py, on the device)               ─► ids [S]
           │    (a row with NaN / +inf logits raises NonFiniteLogitsError instead: its request fails alone)
           └─ logprobs of the rows that asked (logprobs.py)               ─► TokenLogprob per row
    hidden of prompt positions [Q, H] ─ logits ─ log_softmax (raw)        ─► prompt TokenLogprobs

What a request needs beyond its chunk arrives with its first chunk (messages.ScheduledRequestData):
the whole prompt (penalties, prompt logprobs) and the ids that min_tokens holds back.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastdeploy_r3.logprobs import TokenLogprob
from fastdeploy_r3.sampling_params import SamplingParams
from fastdeploy_r3.worker.input_batch import SampleRow
from fastdeploy_r3.worker.messages import ScheduledRequestData
from fastdeploy_r3.worker.sample.draw import HostCopy, SamplingBatch, sample_batch
from fastdeploy_r3.worker.sample.logprobs import LogprobTensors, token_logprobs
from fastdeploy_r3.worker.sample.penalties import TokenStats, apply_penalties, mask_tokens


class NonFiniteLogitsError(ValueError):
    """A request's next-token logits hold NaN or inf: it fails alone (engine/step_isolation.py)."""


@dataclass
class _RequestState:
    params: SamplingParams
    num_prompt_tokens: int
    prompt_token_ids: list[int] | None
    min_tokens_stop_ids: list[int]
    seed: int  # int64 bits of the request's 64-bit seed; the draw's noise is a function of (seed, position)


class StepSampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.stats = TokenStats(vocab_size, device)
        self._requests: dict[str, _RequestState] = {}
        self._unseeded = random.Random()  # seeds for requests that bring none
        self.last_ids: torch.Tensor | None = None  # [S] the last step's ids on the device (a step fed ahead reads them)

    def remember(self, r: ScheduledRequestData) -> None:
        """Keep what the first chunk of a request carries (later chunks carry no params). A failed step
        re-run by the engine's bisection sends them again: the state already kept stays (same seed,
        the prompt counted once for penalties), so the re-run draws what the failed attempt drew."""
        params = r.sampling_params
        if params is None or r.request_id in self._requests:
            return
        seed = r.sampling_seed if r.sampling_seed is not None else self._unseeded.getrandbits(63)
        self._requests[r.request_id] = _RequestState(
            params, r.num_prompt_tokens, r.prompt_token_ids, list(r.min_tokens_stop_ids or []), _as_int64(seed)
        )
        if params.has_penalties:
            if r.prompt_token_ids is None:
                raise ValueError(f"request {r.request_id} has penalties but its first chunk carries no prompt")
            self.stats.add(r.request_id, r.prompt_token_ids)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self.stats.remove(request_id)

    def sample(
        self, logits: torch.Tensor, rows: list[SampleRow]
    ) -> tuple[list[int], dict[int, TokenLogprob]]:
        """logits [S, V] of rows (one or more per sampling request) -> (one token per row, {row index:
        logprob record} for the rows whose params ask for logprobs). Three stages, so that a batched
        device sampler replaces `draw` alone: process -> draw -> finish_async (then its wait)."""
        return self.sample_async(logits, rows).wait()

    def sample_async(self, logits: torch.Tensor, rows: list[SampleRow]) -> PendingSample:
        """`sample` without waiting for the device: the ids and logprobs come with PendingSample.wait()."""
        processed = self.process(logits, rows)  # [S, V]
        ids = self.draw(processed, rows)  # [S]
        return self.finish_async(processed, rows, ids)

    def process(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """logits [S, V] -> float32 logits [S, V] after penalties and min_tokens (the rows without
        either are unchanged); the input may be modified."""
        return self._process(logits.float(), rows, [self._requests[r.request.request_id] for r in rows])

    def draw(self, processed: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """processed [S, V] -> ids [S] int64 on its device: one batched draw for all rows
        (draw.py: greedy rows take the argmax; the others race a counter-hash noise)."""
        states = [self._requests[r.request.request_id] for r in rows]
        for s, r in zip(states, rows):
            # the batched draw would turn these into silent garbage: raise, so the engine's bisection
            # fails this request alone (SamplingParams refuses them; this guards what bypassed it)
            if not math.isfinite(s.params.temperature) or s.params.temperature < 0:
                raise ValueError(f"request {r.request.request_id}: temperature {s.params.temperature} "
                                 "cannot be sampled")
        batch = SamplingBatch.build(
            temperature=[0.0 if s.params.greedy else s.params.temperature for s in states],  # floor: greedy
            top_k=[s.params.top_k for s in states],
            top_p=[s.params.top_p for s in states],
            seeds=[s.seed for s in states],
            counters=[r.position for r in rows],  # position of the token drawn
            device=processed.device,
        )
        return sample_batch(processed, batch)

    def finish_async(self, processed: torch.Tensor, rows: list[SampleRow], ids: torch.Tensor) -> PendingSample:
        """Count the drawn ids [S] for the penalties and take the logprob records the rows asked for
        (from processed [S, V]), every device read of processed enqueued now (a step launched after this
        one may overwrite it: a decode graph's logits buffer); PendingSample.wait() hands both to the
        host. The ids count at once, so that the next step's penalties see them; wait() takes them back
        if the step fails."""
        states = [self._requests[r.request.request_id] for r in rows]
        request_ids = [r.request.request_id for r in rows]
        # a row whose logits hold a NaN or +inf, or no finite value at all, has no distribution to
        # draw from: its id comes back as -1 with the ids (no extra wait) and fails its request
        bad = torch.isnan(processed).any(dim=-1) | ~torch.isfinite(processed.max(dim=-1).values)  # [S]
        self.stats.record(request_ids, ids)
        self.last_ids = ids
        want = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        lp = self._logprob_tensors(processed, states, ids, want) if want else None
        # the step's one wait, later: ids and logprobs land in host memory after the R3 scatter on the same stream
        host = HostCopy([torch.where(bad, -1, ids), *(lp.tensors() if lp is not None else [])])
        return PendingSample(self, request_ids, ids, host, lp, [states[i].params for i in want], want)

    def _logprob_tensors(self, processed: torch.Tensor, states: list[_RequestState], ids: torch.Tensor,
                         want: list[int]) -> LogprobTensors:  # fmt: skip
        """Logprob tensors (on the device) of rows `want`, with the extras their params ask for."""
        device = processed.device
        idx = torch.tensor(want, dtype=torch.int64, device=device)  # [S']
        params = [states[i].params for i in want]
        nums = [p.logprobs or 0 for p in params]
        temps = [0.0 if p.greedy else p.temperature for p in params]  # greedy counts as T = 1
        truncation = None
        if any(p.return_top_p_token_ids for p in params):
            truncation = SamplingBatch.build(temps, [p.top_k for p in params], [p.top_p for p in params],
                                             [0] * len(want), [0] * len(want), device)
        return token_logprobs(processed[idx], ids[idx], max(nums), torch.tensor(temps, device=device),
                              entropy=any(p.return_entropy for p in params), truncation=truncation)

    def _process(self, logits: torch.Tensor, rows: list[SampleRow], states: list[_RequestState]) -> torch.Tensor:
        """Penalties and min_tokens on logits [S, V], in place on the rows that have them."""
        pen = [i for i, s in enumerate(states) if s.params.has_penalties]
        if pen:
            idx = torch.tensor(pen, dtype=torch.int64, device=logits.device)  # [S']
            # counts of the tokens sampled before this step (a verify step's drafts are not among them)
            mask, counts = self.stats.stack([rows[i].request.request_id for i in pen])  # [S', V] each

            def per_row(name: str) -> torch.Tensor:
                return torch.tensor([getattr(states[i].params, name) for i in pen], dtype=torch.float32,
                                    device=logits.device)  # [S']

            logits[idx] = apply_penalties(logits[idx], mask, counts, per_row("repetition_penalty"),
                                          per_row("frequency_penalty"), per_row("presence_penalty"))
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, (r, s) in enumerate(zip(rows, states)):
            num_output = r.position - s.num_prompt_tokens  # tokens generated before the one drawn
            if num_output < s.params.min_tokens:
                ban_rows.extend([i] * len(s.min_tokens_stop_ids))
                ban_ids.extend(s.min_tokens_stop_ids)
        return mask_tokens(logits, ban_rows, ban_ids)

    def prompt_logprobs(
        self,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        hidden: torch.Tensor,
        chunks: list[tuple[int, ScheduledRequestData]],
    ) -> dict[str, tuple[int, list[TokenLogprob]]]:
        """hidden [T, H] of the step, chunks = (row of the chunk's first token in hidden, chunk):
        for requests that asked, the raw logprob of each prompt token this chunk's positions predict.
        A chunk feeding positions [s, e) scores prompt tokens s + 1 .. min(e, P - 1)."""
        rows: list[int] = []
        targets: list[int] = []
        spans: list[tuple[str, int, int, int]] = []  # request id, first scored position, count, N
        for first_row, r in chunks:
            state = self._requests[r.request_id]
            num = state.params.prompt_logprobs
            if num is None or state.prompt_token_ids is None:
                continue
            end = min(r.start_pos + len(r.token_ids), state.num_prompt_tokens - 1)
            count = end - r.start_pos
            if count <= 0:
                continue
            rows.extend(range(first_row, first_row + count))
            targets.extend(state.prompt_token_ids[r.start_pos + 1 : end + 1])
            spans.append((r.request_id, r.start_pos + 1, count, num))
        if not rows:
            return {}
        idx = torch.tensor(rows, dtype=torch.int64, device=hidden.device)  # [Q]
        logits = compute_logits(hidden[idx]).float()  # [Q, V]
        tgt = torch.tensor(targets, dtype=torch.int64, device=logits.device)  # [Q]
        nums = [n for _, _, count, n in spans for _ in range(count)]
        records = token_logprobs(logits, tgt, max(nums)).to_host(nums)
        out: dict[str, tuple[int, list[TokenLogprob]]] = {}
        at = 0
        for rid, first_pos, count, _ in spans:
            out[rid] = (first_pos, records[at : at + count])
            at += count
        return out


def _as_int64(seed: int) -> int:
    """A 64-bit seed (SamplingParams keeps it in [0, 2**64)) as the int64 with the same bits."""
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed {seed} is not a 64-bit integer")
    return seed - 2**64 if seed >= 2**63 else seed


class PendingSample:
    """One step's draw on its way to the host (StepSampler.finish_async); wait() hands it over."""

    def __init__(self, sampler: StepSampler, request_ids: list[str], ids: torch.Tensor, host: HostCopy,
                 logprobs: LogprobTensors | None, params: list[SamplingParams], want: list[int]) -> None:  # fmt: skip
        self.sampler, self.request_ids, self.ids, self.host = sampler, request_ids, ids, host
        self.logprobs, self.params, self.want = logprobs, params, want
        self._discarded = False

    def done(self) -> bool:
        return self.host.done()

    def wait(self) -> tuple[list[int], dict[int, TokenLogprob]]:
        """(one token per row, {row index: logprob record}); raises NonFiniteLogitsError for rows that
        had no distribution, after taking the step's ids back out of the penalty counts (the engine's
        re-run of the other rows, engine/step_isolation.py, counts their tokens once)."""
        host = self.host.wait()
        sampled = host[0].tolist()
        culprits = list(dict.fromkeys(rid for rid, tok in zip(self.request_ids, sampled) if tok < 0))
        if culprits:
            self.discard()
            raise NonFiniteLogitsError(
                f"the model produced non-finite logits (NaN or inf) for the next token of request(s) "
                f"{', '.join(culprits)}; nothing can be sampled from them (check the weights and the input)"
            )
        if self.logprobs is None:
            return sampled, {}
        p = self.params
        res = self.logprobs.with_tensors(host[1:]).to_host(
            [x.logprobs or 0 for x in p], [x.return_entropy for x in p], [x.return_top_p_token_ids for x in p])
        return sampled, dict(zip(self.want, res))

    def discard(self) -> None:
        """The step failed after all: its ids no longer count for the penalties (once, however often called)."""
        if self._discarded:
            return
        self._discarded = True
        with torch.inference_mode():  # the counts were made in the worker's inference mode
            self.sampler.stats.record(self.request_ids, self.ids, -1)
        if self.sampler.last_ids is self.ids:
            self.sampler.last_ids = None
