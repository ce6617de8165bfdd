"""One request computed in the ways a serving engine computes it, for the batch-invariance tests (CPU, the
Triton interpreter, and tests/gpu/test_deterministic_gpu.py): its attention alone, chunked and decoded
(attention_scenarios), and the whole request through an LLM alone, in batches and from the prefix cache
(scenarios).

    probe: 37 tokens (three KV tiles of 16, the last partial), block_size 4
    "alone"        one prefill step of the 37 tokens
    "chunked"      chunks 0..5, 5..21, 21..37, each step shared with fresh prefills of other requests
    "decode"       0..36 alone, then position 36 as a decode token among other requests' decode tokens

Every scenario returns the probe's [37, H, D] outputs; batch-invariant attention gives them bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.model_executor.forward_context import AttentionMetadata
from fastdeploy_r3.model_executor.layers.attention import AttentionBackend
from fastdeploy_r3.outputs import RequestOutput

BS = 4
SEQ = 37
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
MAX_BLOCKS = 16  # 64 positions per request
CHUNKS = ((0, 5), (5, 21), (21, 37))


def _tokens(n: int, seed: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, h, HEAD_DIM, generator=g).to(dtype=dtype, device=device)
                 for h in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip


class _Engine:
    """A KV cache and block tables: request r owns blocks [r * MAX_BLOCKS, (r + 1) * MAX_BLOCKS)."""

    def __init__(self, backend: AttentionBackend, num_requests: int, dtype: torch.dtype, device: str) -> None:
        self.backend, self.dtype, self.device = backend, dtype, device
        shape = (num_requests * MAX_BLOCKS, BS, KV_HEADS, HEAD_DIM)
        noise = torch.Generator().manual_seed(99)
        # a cache full of noise: a position read before it was written would show
        self.kv = (torch.randn(shape, generator=noise).to(dtype=dtype, device=device),
                   torch.randn(shape, generator=noise).to(dtype=dtype, device=device))  # fmt: skip

    def step(self, rows: list[tuple[int, int, int, tuple[torch.Tensor, ...]]]) -> list[torch.Tensor]:
        """rows: (request, first position, last position + 1, its q/k/v [n, ., D] for those positions)."""
        starts, qlens, slens, slots, tables = [0], [], [], [], []
        for request, lo, hi, _ in rows:
            table = torch.arange(request * MAX_BLOCKS, (request + 1) * MAX_BLOCKS)
            pos = torch.arange(lo, hi)
            slots.append(table[pos // BS] * BS + pos % BS)
            tables.append(table)
            starts.append(starts[-1] + hi - lo)
            qlens.append(hi - lo)
            slens.append(hi)
        meta = AttentionMetadata(torch.cat(slots).to(self.device), starts, qlens, slens,
                                 torch.stack(tables).to(self.device), BS)  # fmt: skip
        q, k, v = (torch.cat([t[i] for *_, t in rows]) for i in range(3))
        out = self.backend.forward(q, k, v, self.kv, meta, HEAD_DIM**-0.5)  # [T, H, D]
        return list(out.split(qlens))


def attention_scenarios(backend: AttentionBackend, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    probe = _tokens(SEQ, 0, dtype, device)
    cut = lambda t, lo, hi: tuple(x[lo:hi] for x in t)  # noqa: E731
    got = {"alone": _Engine(backend, 1, dtype, device).step([(0, 0, SEQ, probe)])[0]}

    engine = _Engine(backend, 1 + 3 * 4, dtype, device)
    outs = []
    for i, (lo, hi) in enumerate(CHUNKS):
        others = [(1 + 4 * i + j, 0, n, _tokens(n, 100 + 4 * i + j, dtype, device))
                  for j, n in enumerate((3, 17, 9, 40)[: i + 2])]  # fmt: skip
        outs.append(engine.step([*others[:1], (0, lo, hi, cut(probe, lo, hi)), *others[1:]])[1])
    got["chunked"] = torch.cat(outs)

    engine = _Engine(backend, 1 + 6, dtype, device)
    first = engine.step([(0, 0, SEQ - 1, cut(probe, 0, SEQ - 1))])[0]
    for r, n in enumerate((5, 12, 30, 2, 44, 19), start=1):  # the others' prompts, then one decode token each
        engine.step([(r, 0, n, _tokens(n, 200 + r, dtype, device))])
    decode = [(r, n, n + 1, _tokens(1, 300 + r, dtype, device)) for r, n in enumerate((5, 12, 30, 2, 44, 19), 1)]
    last = engine.step([*decode[:3], (0, SEQ - 1, SEQ, cut(probe, SEQ - 1, SEQ)), *decode[3:]])[3]
    got["decode"] = torch.cat([first, last])
    return got


# -- the whole request through an LLM ---------------------------------------------------------------

BATCHES = (1, 7, 32, 63)
PROBE = SamplingParams(temperature=1.0, seed=7, max_tokens=5, logprobs=2, ignore_eos=True)
R3 = {"enable_routing_replay": True, "debug_mode": False}

_rng = np.random.default_rng(2024)
PROBE_PROMPT = [int(t) for t in _rng.integers(0, 500, 21)]
OTHERS = [[int(t) for t in _rng.integers(0, 500, int(n))] for n in _rng.integers(3, 41, max(BATCHES))]
OTHER_PARAMS = [
    SamplingParams(temperature=float(t), seed=int(s), max_tokens=int(m), ignore_eos=True)
    for t, s, m in zip(_rng.uniform(0.0, 1.5, max(BATCHES)), _rng.integers(0, 1000, max(BATCHES)),
                       _rng.integers(1, 7, max(BATCHES)), strict=True)
]  # fmt: skip

Fingerprint = tuple[list[int], list[tuple[float, tuple[tuple[int, float], ...]]], bytes]


def fingerprint(out: RequestOutput) -> Fingerprint:
    """The probe's tokens, logprobs (chosen and top-2, as floats: compared bit for bit) and R3 rows."""
    completion = out.outputs[0]
    assert completion.logprobs is not None and completion.routed_experts is not None
    logprobs = [(lp.logprob, tuple(lp.top)) for lp in completion.logprobs]
    return list(completion.token_ids), logprobs, completion.routed_experts.tobytes()


def in_batch(llm: LLM, num_others: int, cached_tokens: int = 0) -> Fingerprint:
    """The probe submitted in the middle of num_others random requests, all in one generate(); the prefix
    cache emptied first unless the probe is to hit `cached_tokens` of it."""
    if not cached_tokens:
        llm.engine.control.flush_cache()
    at = num_others // 2
    prompts = OTHERS[:at] + [PROBE_PROMPT] + OTHERS[at:num_others]
    params = OTHER_PARAMS[:at] + [PROBE] + OTHER_PARAMS[at:num_others]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[at].prompt_token_ids == PROBE_PROMPT
    assert outs[at].num_cached_tokens == cached_tokens
    return fingerprint(outs[at])


def scenarios(llm: LLM, block_size: int = BS) -> dict[str, Fingerprint]:
    """The probe alone, in each batch (each time computed whole: the prefix cache emptied), and alone again
    right after itself (its prompt's whole blocks a prefix-cache hit: 5 of 4 tokens, the last token computed)."""
    got = {"alone": in_batch(llm, 0)}
    for n in BATCHES:
        got[f"with {n} others"] = in_batch(llm, n)
    got["prefix-cache hit"] = in_batch(llm, 0, cached_tokens=len(PROBE_PROMPT) // block_size * block_size)
    return got


def differing(got: dict[str, Fingerprint]) -> list[str]:
    return [name for name, fp in got.items() if fp != got["alone"]]
