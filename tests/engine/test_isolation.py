"""Issue 11, F1: one request never fails its neighbours. Parameters the sampler cannot run are refused
or made safe at validation; a request that still makes a step raise fails alone, with a clear
message, while the rest of its step is re-run and served exactly as if it had never been there.

Tiny fake Qwen3-MoE, block_size 4, R3 in debug mode (rows = positions), through offline LLM.
"""

from __future__ import annotations

import numpy as np
import pytest

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.outputs import RequestOutput
from fastdeploy_r3.sampling_params import InvalidRequestError

PROMPTS = [[10, 11, 12, 13, 14], [20, 21, 22], [30, 31, 32, 33], [40, 41]]
R3_DEBUG = {"enable_routing_replay": True, "debug_mode": True}


@pytest.fixture(scope="module")
def llm(fake_model_dir) -> LLM:
    with LLM(fake_model_dir("qwen3_moe"), block_size=4, routing_replay_config=R3_DEBUG) as engine:
        yield engine


def _params(seed: int | None = None, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=5, ignore_eos=True)


def _check_rows(out: RequestOutput) -> None:
    comp = out.outputs[0]
    rows = len(out.prompt_token_ids) + len(comp.token_ids) - 1
    np.testing.assert_array_equal(comp.routed_experts[:, 0, 0], np.arange(rows) % 255)


@pytest.mark.parametrize("temperature", [1e-300, 1e-6])
def test_a_vanishing_temperature_samples_greedily_beside_its_neighbours(llm: LLM, temperature: float) -> None:
    """F1: temperature 1e-300 passed validation and made the whole step raise."""
    params = [_params(seed=1), _params(temperature=temperature), _params(seed=2), _params(temperature=0.0)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 4
    greedy = llm.generate([PROMPTS[1]], _params(temperature=0.0), use_tqdm=False)[0]
    assert outs[1].outputs[0].token_ids == greedy.outputs[0].token_ids


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 1.5, True])
def test_seeds_outside_64_bits_are_refused(seed) -> None:
    """F1: a seed >= 2**64 passed validation and made torch.Generator.manual_seed raise in the step."""
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=seed)


def test_seeds_are_reduced_to_64_bits_as_torch_reads_them(llm: LLM) -> None:
    assert SamplingParams(seed=-1).seed == 2**64 - 1
    assert SamplingParams(seed=2**64 - 1, n=3).choice_seed(2) == 1  # choice seeds wrap too
    a, b = llm.generate([PROMPTS[0]] * 2, [_params(seed=-1), _params(seed=2**64 - 1)], use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5])
def test_non_finite_or_negative_temperatures_are_refused(temperature: float) -> None:
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=temperature)


def _smuggle(params: SamplingParams, **fields) -> SamplingParams:
    """What validation would refuse, set after construction: a stand-in for any input that makes a
    worker step raise and that validation does not know about yet."""
    for k, v in fields.items():
        setattr(params, k, v)
    return params


@pytest.mark.parametrize("poison", [{"temperature": float("nan")}, {"seed": 2**64}])
def test_a_request_that_makes_the_step_raise_fails_alone(llm: LLM, poison: dict) -> None:
    """F1: any exception inside the step failed every request of the batch (500 for all).

    The culprit sits third in the batch, so the seeded requests before it have sampled (advanced
    their generators) when the step raises: after the re-run they must still match a clean run."""
    clean = [_params(seed=7), _params(temperature=0.0), _params(seed=9)]
    want = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]], clean, use_tqdm=False)

    mixed = [_params(seed=7), _params(temperature=0.0), _smuggle(_params(seed=3), **poison), _params(seed=9)]
    outs = llm.generate(PROMPTS, mixed, use_tqdm=False)

    culprit = outs[2].outputs[0]
    assert culprit.finish_reason == "error" and culprit.routed_experts is None
    assert culprit.error.startswith("the model step failed on this request alone (")
    assert "other requests of the step were served" in culprit.error
    served = [outs[0], outs[1], outs[3]]
    assert [o.outputs[0].finish_reason for o in served] == ["length"] * 3
    assert [o.outputs[0].token_ids for o in served] == [o.outputs[0].token_ids for o in want]
    for out in served:
        _check_rows(out)
    # and the engine goes on serving
    again = llm.generate([PROMPTS[0]], [_params(seed=7)], use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want[0].outputs[0].token_ids
