"""The all-to-all dispatch (--moe-a2a-backend alltoall, layers/expert_alltoall.py) in real engines on CPU
(gloo): each rank sends its slice of the step's (token, k) rows to the ranks of their experts, gets the
results back, sums its tokens over k and all-gathers; GLM-4.5's shared experts are then all-reduced on
their own. At EP=2 and EP=4 the greedy tokens and R3 rows (logical ids) equal EP=1's bit for bit through
prefix hits, swaps and preemption (tests/expert_parallel_runs.py: prompts, checkpoints, comparison).
"""

from __future__ import annotations

import pytest
from expert_parallel_runs import Run, assert_same_run, checkpoints, generate


@pytest.fixture(scope="module")
def glm_ep1(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Run]:
    """glm4_moe's checkpoint (4 kv heads) and its EP=1 run, computed once."""
    model = checkpoints(tmp_path_factory)("glm4_moe")
    return model, generate(model, ep=1)


@pytest.mark.parametrize("ep", [2, 4])
def test_alltoall_tokens_and_r3_rows_equal_ep1_glm4_moe(glm_ep1: tuple[str, Run], ep: int) -> None:
    model, one = glm_ep1
    assert_same_run(generate(model, ep=ep, moe_a2a_backend="alltoall"), one, "glm4_moe", ep_size=ep)
