"""Tensor parallelism on CPU (gloo): two worker ranks, each holding half of every attention head group,
dense MLP and expert, give the same greedy tokens and bit-identical R3 rows as one rank; through
the CPU swap tier too; a size that does not divide the heads is refused; nothing leaks at shutdown.

Tiny fake models: 4 heads, 2 kv heads, moe_intermediate 32, intermediate 128 (TP=2 divides all).
"""

from __future__ import annotations

import multiprocessing
import os
import random
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pytest
import torch

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.config import ConfigError, EngineConfig, ModelConfig
from fastdeploy_r3.model_executor.model_loader import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
R3 = {"enable_routing_replay": True}
FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe")


def _prompts() -> list[list[int]]:
    """Three 12-token prefixes, each reused by two requests with different tails, interleaved."""
    rng = random.Random(3)
    bases = [[rng.randrange(3, 500) for _ in range(12)] for _ in range(3)]
    return [bases[i % 3] + [rng.randrange(3, 500) for _ in range(1 + i % 2)] for i in range(6)]


PROMPTS = _prompts()


class Run(NamedTuple):
    tokens: list[list[int]]
    rows: list[np.ndarray]  # per request [rows, L, K]
    metrics: dict


def _shm_segments(suffix: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"fdr3_{suffix}_")]


def generate(model: str, tp: int, **kw: object) -> Run:
    """Greedy tokens, R3 rows and metrics of one engine run; checks that shutdown leaves nothing behind."""
    with LLM(model, tensor_parallel_size=tp, block_size=4, max_num_seqs=2, routing_replay_config=R3, **kw) as llm:
        pids = llm.engine.workers.pids
        suffix = llm.engine.suffix
        assert len(pids) == tp and _shm_segments(suffix)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        metrics = llm.engine.metrics()
    for o in outs:
        assert o.outputs[0].error is None, o.outputs[0].error
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert _shm_segments(suffix) == []
    return Run([o.outputs[0].token_ids for o in outs], [o.outputs[0].routed_experts for o in outs], metrics)


def assert_same_rows(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == w.dtype, (i, g.shape, w.shape)
        diff = np.argwhere(g != w)
        # a mismatch is a sharding bug or a near-tie flipped by the all-reduce's rounding: report where,
        # never loosen
        assert diff.size == 0, f"request {i}: {len(diff)} R3 entries differ, first [row, layer, k] = {diff[0]}"


@pytest.fixture(scope="module")
def tp1(fake_model_dir: Callable[[str], str]) -> Callable[[str], Run]:
    """tp1(family) -> the TP=1 reference run (big cache, no swapping), computed once per family."""
    cache: dict[str, Run] = {}

    def get(family: str) -> Run:
        if family not in cache:
            cache[family] = generate(fake_model_dir(family), tp=1, num_gpu_blocks_override=128)
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_tokens_and_r3_rows_equal_tp1(fake_model_dir, tp1, family: str) -> None:
    """Same prompts, same big cache: TP=2 samples the same tokens and writes the same R3 rows, bit for bit."""
    run = generate(fake_model_dir(family), tp=2, num_gpu_blocks_override=128)
    assert run.tokens == tp1(family).tokens
    assert_same_rows(run.rows, tp1(family).rows)


def test_tp2_swaps_through_the_cpu_tier_and_still_matches(fake_model_dir, tp1) -> None:
    """10 GPU blocks hold two requests: shared prefixes leave for the CPU tier (both ranks' KV) and come back."""
    run = generate(fake_model_dir("qwen3_moe"), tp=2, num_gpu_blocks_override=10, num_cpu_blocks_override=32)
    assert run.metrics["swap_out_blocks"] > 0 and run.metrics["swap_in_blocks"] > 0, run.metrics
    assert run.tokens == tp1("qwen3_moe").tokens
    assert_same_rows(run.rows, tp1("qwen3_moe").rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_loads_its_half_of_the_full_checkpoint(fake_model_dir, family: str) -> None:
    """A rank's model expects the full HF tensors, holds half of every split one, and half the kv heads."""
    mc = ModelConfig(model=fake_model_dir(family))
    full = load_model(mc, torch.device("cpu"))
    ranks = [load_model(mc, torch.device("cpu"), tp_rank=r, tp_size=2) for r in range(2)]
    assert [m.checkpoint_weight_shapes() for m in ranks] == [full.checkpoint_weight_shapes()] * 2
    assert [m.num_kv_heads for m in ranks] == [full.num_kv_heads // 2] * 2 == [1, 1]
    attn = [m.model.layers[1].self_attn for m in [full, *ranks]]
    # q_proj rows = heads: rank 0 holds heads 0-1, rank 1 heads 2-3
    q_rows = [a.qkv_proj.shard("q") for a in attn]  # [NH / N * D, H] views of the merged weight
    assert torch.equal(torch.cat(q_rows[1:]), q_rows[0])
    v_rows = [a.qkv_proj.shard("v") for a in attn]
    assert torch.equal(torch.cat(v_rows[1:]), v_rows[0])
    assert torch.equal(torch.cat([attn[1].o_proj.weight, attn[2].o_proj.weight], dim=1), attn[0].o_proj.weight)
    moe = [m.model.layers[1].mlp for m in [full, *ranks]]
    assert torch.equal(moe[1].gate.weight, moe[0].gate.weight)  # the router is replicated
    gate_up = [m.experts.w13.unflatten(1, (2, -1)) for m in moe]  # [E, 2 (gate, up), I, H]
    assert torch.equal(torch.cat(gate_up[1:], dim=2), gate_up[0])
    assert torch.equal(torch.cat([moe[1].experts.w2, moe[2].experts.w2], dim=2), moe[0].experts.w2)


def test_tp_that_does_not_divide_the_heads_is_refused(fake_model_dir) -> None:
    """TP=3 splits neither 4 heads nor 2 kv heads; TP=4 splits the heads but not the kv heads."""
    model = fake_model_dir("qwen3_moe")
    with pytest.raises(ConfigError, match=r"num_attention_heads=4, num_key_value_heads=2.*use one of: 1, 2$"):
        EngineConfig.from_kwargs(model, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match=r"does not divide num_key_value_heads=2;"):
        EngineConfig.from_kwargs(model, tensor_parallel_size=4)
