"""Expert parallelism over four ranks on CPU (gloo, four worker processes): attention split by heads as
under TP=4, the routed experts not split: rank r holds a contiguous quarter of them whole. On the tiny
checkpoints transformers itself writes (tests/hf_checkpoints.py), for all three families, EP=4 gives the
greedy tokens and the R3 rows (logical expert ids) of EP=1 bit for bit, through prefix hits, the CPU swap
tier and preemption (both engines run the same schedule on the same 8-block cache); each rank holds
exactly a quarter of the expert bytes.

qwen3_moe and mixtral run the local dispatch; glm4_moe (shared experts) runs the all-to-all one
(--moe-a2a-backend alltoall, layers/expert_alltoall.py: each rank sends its slice of the step's (token, k)
rows to their experts' ranks, sums its tokens over k and all-gathers; the shared experts are all-reduced on
their own), at EP=4 and EP=2; every family also runs the local dispatch at EP=2. Each family's EP=1 run is
computed once.

The prompts, the checkpoints (4 kv heads, so that four ranks split them) and the comparison:
tests/expert_parallel_runs.py.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from expert_parallel_runs import NUM_EXPERTS, Run, assert_same_run, checkpoints, generate
from hf_checkpoints import FAMILIES

from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.model_executor.layers.moe import StackedExperts
from fastdeploy_r3.model_executor.model_loader import expert_placement_for, load_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    return checkpoints(tmp_path_factory)


@pytest.fixture(scope="module")
def ep1_run(checkpoint: Callable[[str], str]) -> Callable[[str], Run]:
    """ep1_run(family) -> EP=1's run on the family's checkpoint, computed once."""
    cache: dict[str, Run] = {}

    def get(family: str) -> Run:
        if family not in cache:
            cache[family] = generate(checkpoint(family), ep=1)
        return cache[family]

    return get


@pytest.mark.parametrize(("family", "ep", "a2a"), [("qwen3_moe", 4, "local"), ("mixtral", 4, "local"),
                                                   ("glm4_moe", 4, "alltoall"), ("qwen3_moe", 2, "local"),
                                                   ("mixtral", 2, "local"), ("glm4_moe", 2, "local"),
                                                   ("glm4_moe", 2, "alltoall")])
def test_expert_parallel_tokens_and_r3_rows_equal_ep1(checkpoint, ep1_run, family: str, ep: int, a2a: str) -> None:
    """EP ranks, each with 1/EP of the experts, through prefix hits, swaps and preemptions: EP=1's tokens and
    R3 rows, bit for bit."""
    assert_same_run(generate(checkpoint(family), ep=ep, moe_a2a_backend=a2a), ep1_run(family), family, ep_size=ep)


def _expert_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for m in model.modules() if isinstance(m, StackedExperts)
               for t in m.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_each_of_four_ranks_holds_a_quarter_of_the_expert_bytes(checkpoint, family: str) -> None:
    """The ranks the worker loads (expert_placement_for, as worker/model_runner.py does) hold a contiguous
    quarter of the experts whole: exactly 1/4 of the whole model's expert bytes, equal to those experts."""
    config = EngineConfig.from_kwargs(checkpoint(family), tensor_parallel_size=4, enable_expert_parallel=True)
    mc, cpu = config.model_config, torch.device("cpu")
    whole = load_model(mc, cpu)
    ranks = [load_model(mc, cpu, r, 4, expert_placement_for(config.parallel_config, mc, r)) for r in range(4)]
    total, quarter = _expert_bytes(whole), NUM_EXPERTS[family] // 4
    assert total > 0 and total % 4 == 0 and [_expert_bytes(m) for m in ranks] == [total // 4] * 4
    assert [m.expert_placement.local_experts for m in ranks] == [
        tuple(range(r * quarter, (r + 1) * quarter)) for r in range(4)
    ]
    layers = [[m for m in model.modules() if isinstance(m, StackedExperts)] for model in (whole, *ranks)]
    for full, *parts in zip(*layers, strict=True):
        assert torch.equal(torch.cat([p.w13 for p in parts]), full.w13)
        assert torch.equal(torch.cat([p.w2 for p in parts]), full.w2)
