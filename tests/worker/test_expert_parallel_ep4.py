"""Expert parallelism over four ranks on CPU (gloo, four worker processes): attention split by heads as
under TP=4, the routed experts not split: rank r holds a contiguous quarter of them whole. On the tiny
checkpoints transformers itself writes (tests/hf_checkpoints.py), for all three families, EP=4 gives the
greedy tokens and the R3 rows (logical expert ids) of EP=1 bit for bit, through prefix hits, the CPU swap
tier and preemption (both engines run the same schedule on the same 8-block cache); each rank holds
exactly a quarter of the expert bytes.

The prompts, the checkpoints (4 kv heads, so that four ranks split them) and the comparison:
tests/expert_parallel_runs.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from expert_parallel_runs import NUM_EXPERTS, assert_same_run, checkpoints, generate
from hf_checkpoints import FAMILIES

from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.model_executor.layers.moe import StackedExperts
from fastdeploy_r3.model_executor.model_loader import expert_placement_for, load_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    return checkpoints(tmp_path_factory)


@pytest.mark.parametrize("family", FAMILIES)
def test_ep4_tokens_and_r3_rows_equal_ep1(checkpoint, family: str) -> None:
    """Four ranks, each with a quarter of the experts, through prefix hits, swaps and preemptions: EP=1's tokens
    and R3 rows, bit for bit."""
    model = checkpoint(family)
    assert_same_run(generate(model, ep=4), generate(model, ep=1), family, ep_size=4)


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
