"""Penalties and logprobs computed on CUDA equal the CPU's: the batched ops on random logits, and a
whole engine (tiny qwen3_moe, float32) with penalties, logprobs and prompt logprobs.

Runs through the device tool (an H200): python -m pytest -m gpu tests/gpu/test_cuda_logprobs.py -v
"""

from __future__ import annotations

import pytest
import torch
from fake_model import make_fake_model

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.worker.sample.logprobs import token_logprobs
from fastdeploy_r3.worker.sample.penalties import TokenStats, apply_penalties

pytestmark = pytest.mark.gpu


def test_batched_ops_on_cuda_equal_cpu() -> None:
    """8 rows over a 1000-token vocabulary: penalised logits and logprob records agree to 1e-5."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 1000, generator=gen) * 4
    ids = torch.randint(0, 1000, (8,), generator=gen)
    rep, freq, pres = torch.rand(8, generator=gen) + 0.5, torch.rand(8, generator=gen), torch.rand(8, generator=gen)
    results = []
    for dev in (torch.device("cpu"), torch.device("cuda")):
        stats = TokenStats(1000, dev)
        for r in range(8):
            stats.add(f"r{r}", list(range(r, 1000, 97)))
            stats.record([f"r{r}"], torch.tensor([r * 11], device=dev))
        mask, counts = stats.stack([f"r{r}" for r in range(8)])
        z = apply_penalties(logits.to(dev), mask, counts, rep.to(dev), freq.to(dev), pres.to(dev))
        recs = token_logprobs(z, ids.to(dev), 5, torch.full((8,), 0.7, device=dev)).to_host([5] * 8)
        results.append((z.cpu(), recs))
    (z_cpu, r_cpu), (z_gpu, r_gpu) = results
    torch.testing.assert_close(z_gpu, z_cpu, atol=1e-5, rtol=1e-5)
    for a, b in zip(r_cpu, r_gpu):
        assert a.token_id == b.token_id and a.rank == b.rank and abs(a.logprob - b.logprob) < 1e-5
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_engine_logprobs_on_cuda_equal_cpu(tmp_path) -> None:
    """Greedy with penalties, logprobs=3 and prompt_logprobs=2 on three prompts: same tokens, records
    within 1e-3 (different matmul kernels)."""
    model_dir = make_fake_model("qwen3_moe", str(tmp_path / "qwen3"), preset="tiny", seed=0)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.5, logprobs=3, prompt_logprobs=2)
    prompts = [{"prompt_token_ids": [11, 12, 13, 12, 11, 40 + i]} for i in range(3)]
    runs = []
    for device in ("cpu", "cuda"):
        with LLM(model_dir, device=device, dtype="float32", block_size=4, max_num_seqs=4) as llm:
            runs.append(llm.generate(prompts, params, use_tqdm=False))
    for cpu, gpu in zip(*runs):
        c, g = cpu.outputs[0], gpu.outputs[0]
        assert c.token_ids == g.token_ids
        for a, b in zip(c.logprobs + cpu.prompt_logprobs[1:], g.logprobs + gpu.prompt_logprobs[1:]):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-3
        assert gpu.prompt_logprobs[0] is None and len(gpu.prompt_logprobs) == 6
