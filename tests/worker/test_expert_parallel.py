"""Expert parallelism on CPU (gloo): two worker ranks, attention split by heads as under TP, the routed
experts NOT split: rank 0 holds experts 0..7 whole, rank 1 experts 8..15 (tiny fakes have 16). Each
rank runs only the rows routed to its experts and the MoE all-reduce adds the two halves, so EP=2 gives
the greedy tokens and the R3 rows (logical expert ids) of one rank, through prefix hits, for all three
families, through the CPU swap tier and with redundant experts (EPLB); each rank holds exactly half the
expert bytes; an update from disk reads only a rank's own experts and equals a fresh engine.

Tiny fake models: 4 heads, 2 kv heads, 16 experts, top-4, block size 4.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pytest
import torch

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.config import ConfigError, EngineConfig
from fastdeploy_r3.model_executor.layers.moe import StackedExperts
from fastdeploy_r3.model_executor.model_loader import expert_placement_for, load_model

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
R3 = {"enable_routing_replay": True}


def _prompts() -> list[list[int]]:
    """Two 12-token prefixes (3 blocks), each reused by later requests with different tails: prefix hits."""
    rng = random.Random(5)
    bases = [[rng.randrange(3, 500) for _ in range(12)] for _ in range(2)]
    return [bases[i % 2] + [rng.randrange(3, 500) for _ in range(1 + i % 3)] for i in range(5)]


PROMPTS = _prompts()


class Run(NamedTuple):
    tokens: list[list[int]]
    rows: list[np.ndarray]  # per request [rows, L, K] logical expert ids
    metrics: dict  # the engine's counters: prefix_hit_blocks, swap_out_blocks, swap_in_blocks...


def generate(model: str, tp: int, **kw: object) -> Run:
    kw.setdefault("num_gpu_blocks_override", 64)
    with LLM(model, tensor_parallel_size=tp, block_size=4, max_num_seqs=2, routing_replay_config=R3, **kw) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        metrics = llm.engine.metrics()
    for o in outs:
        assert o.outputs[0].error is None, o.outputs[0].error
    return Run([o.outputs[0].token_ids for o in outs], [o.outputs[0].routed_experts for o in outs], metrics)


@pytest.fixture(scope="module")
def one_rank(fake_model_dir) -> Callable[[str], Run]:
    """one_rank(family) -> the TP=1 reference run, computed once per family."""
    cache: dict[str, Run] = {}

    def get(family: str) -> Run:
        if family not in cache:
            cache[family] = generate(fake_model_dir(family), tp=1)
        return cache[family]

    return get


def assert_same_run(ep: Run, one: Run, same_cache: bool = True) -> None:
    """Same tokens and R3 rows; same_cache: both engines also hit the same cached prefix blocks."""
    if same_cache:
        assert ep.metrics["prefix_hit_blocks"] > 0
        assert ep.metrics["prefix_hit_blocks"] == one.metrics["prefix_hit_blocks"]
    assert ep.tokens == one.tokens
    for i, (got, want) in enumerate(zip(ep.rows, one.rows, strict=True)):
        assert got.shape == want.shape == (len(PROMPTS[i]) + GREEDY.max_tokens - 1, *want.shape[1:])
        diff = np.argwhere(got != want)
        # a mismatch is a dispatch bug (a slot or rank id in a row) or a near-tie flipped by rounding: report
        # where, never loosen
        assert diff.size == 0, f"request {i}: {len(diff)} R3 entries differ, first [row, layer, k] = {diff[0]}"
    # logical ids of both ranks' experts, not slots 0..7 of either
    all_ids = np.concatenate([r.reshape(-1) for r in ep.rows])
    assert all_ids.min() >= 0 and all_ids.max() >= 8 and (all_ids < 8).any()


def test_ep2_tokens_and_r3_rows_equal_one_rank_glm4_moe(fake_model_dir, one_rank) -> None:
    """Same prompts, same cache: EP=2 samples the same tokens and writes the same logical R3 rows, bit for bit,
    and its later requests hit the cached prefixes of the earlier ones."""
    assert_same_run(generate(fake_model_dir("glm4_moe"), tp=2, enable_expert_parallel=True), one_rank("glm4_moe"))


def test_ep2_through_the_cpu_tier_equals_one_rank_mixtral(fake_model_dir, one_rank) -> None:
    """7 GPU blocks for two requests: EP=2's cached prefixes (both ranks' KV) leave for the CPU tier and come
    back, and the tokens and R3 rows are still one rank's (which never swapped)."""
    run = generate(fake_model_dir("mixtral"), tp=2, enable_expert_parallel=True, num_gpu_blocks_override=7,
                   num_cpu_blocks_override=32)
    assert run.metrics["swap_out_blocks"] > 0 and run.metrics["swap_in_blocks"] > 0, run.metrics
    assert_same_run(run, one_rank("mixtral"), same_cache=False)


def test_ep2_equals_one_rank_before_and_after_an_update_from_disk(fake_model_dir, one_rank) -> None:
    """qwen3_moe: EP=2 equals one rank on the seed-0 weights; updated from disk to the seed-1 checkpoint it
    equals one rank started on those (which EP=2 started on them equals, by the test above), and its
    outputs changed; the old version's cached prefixes are not hit."""
    old, new = fake_model_dir("qwen3_moe", seed=0), fake_model_dir("qwen3_moe", seed=1)
    want_new = generate(new, tp=1)
    with LLM(old, tensor_parallel_size=2, enable_expert_parallel=True, block_size=4, max_num_seqs=2,
             num_gpu_blocks_override=64, routing_replay_config=R3) as llm:
        before = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        hits_before = llm.engine.metrics()["prefix_hit_blocks"]
        assert llm.update_weights(new) == "1"
        after = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        hits_after = llm.engine.metrics()["prefix_hit_blocks"] - hits_before
    runs = [Run([o.outputs[0].token_ids for o in outs], [o.outputs[0].routed_experts for o in outs],
                {"prefix_hit_blocks": hits}) for outs, hits in ((before, hits_before), (after, hits_after))]
    assert_same_run(runs[0], one_rank("qwen3_moe"))
    assert_same_run(runs[1], want_new)
    assert runs[1].tokens != runs[0].tokens


def test_ep2_with_redundant_experts_keeps_logical_r3_rows(fake_model_dir, one_rank, tmp_path) -> None:
    """EPLB: 20 physical slots for 16 experts (experts 0, 5, 7, 12 twice), no slot p holding expert p. The R3
    rows are the router's logical ids, equal to one rank's, and so are the tokens."""
    p2l = [(p + 5) % 16 for p in range(16)] + [0, 7, 12, 5]
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"physical_to_logical": p2l}))
    run = generate(fake_model_dir("qwen3_moe"), tp=2, enable_expert_parallel=True, expert_placement_file=str(path))
    assert_same_run(run, one_rank("qwen3_moe"))


def test_a_placement_file_that_misses_an_expert_is_refused(fake_model_dir, tmp_path) -> None:
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"physical_to_logical": list(range(1, 16)) + [1]}))
    with pytest.raises(ConfigError, match=r"placement.json' holds no replica of expert 0; list every logical"):
        EngineConfig.from_kwargs(fake_model_dir("qwen3_moe"), tensor_parallel_size=2, enable_expert_parallel=True,
                                 expert_placement_file=str(path))
    with pytest.raises(ConfigError, match=r"needs expert parallelism: add --enable-expert-parallel"):
        EngineConfig.from_kwargs(fake_model_dir("qwen3_moe"), expert_placement_file=str(path))


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_each_rank_holds_half_the_expert_bytes(fake_model_dir, family: str) -> None:
    """The ranks the worker loads (expert_placement_for, as worker/model_runner.py does) hold experts 0..7 and
    8..15 whole: each exactly half of the whole model's expert bytes, equal to its experts' weights."""
    config = EngineConfig.from_kwargs(fake_model_dir(family), tensor_parallel_size=2, ep_size=2)
    mc, cpu = config.model_config, torch.device("cpu")
    whole = load_model(mc, cpu)
    ranks = [load_model(mc, cpu, r, 2, expert_placement_for(config.parallel_config, mc, r)) for r in range(2)]

    def experts(model: torch.nn.Module) -> list[StackedExperts]:
        return [m for m in model.modules() if isinstance(m, StackedExperts)]

    def expert_bytes(model: torch.nn.Module) -> int:
        return sum(t.numel() * t.element_size() for m in experts(model) for t in m.parameters())

    total = expert_bytes(whole)
    assert total > 0 and [expert_bytes(m) for m in ranks] == [total // 2] * 2 and total % 2 == 0
    assert [m.expert_placement.local_experts for m in ranks] == [tuple(range(8)), tuple(range(8, 16))]
    for full, lo, hi in zip(experts(whole), experts(ranks[0]), experts(ranks[1]), strict=True):
        assert torch.equal(torch.cat([lo.w13, hi.w13]), full.w13) and torch.equal(torch.cat([lo.w2, hi.w2]), full.w2)


def test_update_from_disk_reads_only_this_ranks_experts(fake_model_dir, monkeypatch) -> None:
    """Rank 1 of EP=2 updated from disk reads experts 8..15 only and then holds exactly the experts a fresh
    rank 1 loads from the new checkpoint (and every other weight of it)."""
    from fastdeploy_r3.worker import weight_updater

    old, new = fake_model_dir("qwen3_moe", seed=0), fake_model_dir("qwen3_moe", seed=1)
    config = EngineConfig.from_kwargs(old, tensor_parallel_size=2, enable_expert_parallel=True)
    cpu, placement = torch.device("cpu"), expert_placement_for(config.parallel_config, config.model_config, 1)
    model = load_model(config.model_config, cpu, 1, 2, placement)
    fresh = load_model(EngineConfig.from_kwargs(new, tensor_parallel_size=2, ep_size=2).model_config, cpu, 1, 2,
                       placement)
    read: set[str] = set()
    real = weight_updater.iter_checked_safetensors

    def spy(files, device, keep=None):  # noqa: ANN001, ANN202 (test spy)
        for name, tensor in real(files, device, keep):
            read.add(name)
            yield name, tensor

    monkeypatch.setattr(weight_updater, "iter_checked_safetensors", spy)
    weight_updater.WeightUpdater(model, cpu, 1).from_disk(new)
    assert {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n} == set(range(8, 16))
    mine, want = model.state_dict(), fresh.state_dict()
    assert mine.keys() == want.keys() and all(torch.equal(mine[k], want[k]) for k in mine)
