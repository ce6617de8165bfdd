"""Multi-token steps: a worker that returns K = 3 tokens per request per step (k_token_runner.py) is
served by the same engine path as one that returns one. Same tokens, logprobs and R3 rows as a
one-token engine; a stop inside a step's list ends the request there and drops the rest; in debug
mode every returned row equals its position, P + N - 1 rows; blocks computed in the lookahead slots
are prefix-cached like any other."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from engine_runs import run_requests
from k_token_runner import K, KTokenRunner

from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.engine.engine_service import EngineService
from fastdeploy_r3.outputs import RequestOutput
from fastdeploy_r3.sampling_params import SamplingParams

BS = 4
PROMPT = [7, 21, 5, 300, 42, 9, 77, 12, 3, 150]  # 10 tokens: two full blocks and a half
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # 8 = 3 + 3 + 2 of the last list
SEEDED = SamplingParams(temperature=0.9, seed=11, max_tokens=7, ignore_eos=True, logprobs=2)


def _config(model_dir: str) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model_dir, block_size=BS, num_gpu_blocks_override=32, max_num_seqs=4, max_num_batched_tokens=32,
        routing_replay_config={"enable_routing_replay": True, "debug_mode": True},
    )


def _assert_rows_are_positions(out: RequestOutput, prompt: list[int]) -> None:
    comp = out.outputs[0]
    assert comp.error is None, comp.error
    rows = comp.routed_experts
    end = len(prompt) + len(comp.token_ids) - 1  # P + N - 1: the last token was never fed
    assert rows.shape[0] == end
    want = (np.arange(end) % 255).astype(np.uint8)[:, None, None]
    assert np.array_equal(rows, np.broadcast_to(want, rows.shape))


@pytest.fixture(scope="module")
def one_token(fake_model_dir: Callable[..., str]) -> dict[str, RequestOutput]:
    """The reference: the same requests on the ordinary one-token runner."""
    engine = EngineService(_config(fake_model_dir("qwen3_moe")))
    try:
        return run_requests(engine, {"greedy": (PROMPT, GREEDY), "seeded": (PROMPT[:7], SEEDED)})
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def k_engine(fake_model_dir: Callable[..., str]):  # noqa: ANN201 - a generator of EngineService
    engine = EngineService(_config(fake_model_dir("qwen3_moe")), runner_cls=KTokenRunner)
    yield engine
    engine.shutdown()


def test_k_tokens_per_step_give_the_one_token_engine_s_tokens_logprobs_and_rows(
    k_engine: EngineService, one_token: dict[str, RequestOutput]
) -> None:
    """Greedy (8 tokens: the last step's third token is past max_tokens, dropped) and seeded sampling
    with logprobs: token for token what one token per step gives, and P + N - 1 rows of positions."""
    assert k_engine.scheduler.num_lookahead_tokens == K - 1
    got = run_requests(k_engine, {"greedy": (PROMPT, GREEDY), "seeded": (PROMPT[:7], SEEDED)})
    for rid, prompt in (("greedy", PROMPT), ("seeded", PROMPT[:7])):
        comp, ref = got[rid].outputs[0], one_token[rid].outputs[0]
        assert comp.token_ids == ref.token_ids and comp.finish_reason == ref.finish_reason == "length"
        assert np.array_equal(comp.routed_experts, ref.routed_experts)
        _assert_rows_are_positions(got[rid], prompt)
    assert len(got["greedy"].outputs[0].token_ids) == 8
    assert got["seeded"].outputs[0].logprobs == one_token["seeded"].outputs[0].logprobs
    assert len(got["seeded"].outputs[0].logprobs) == 7


def test_a_stop_token_inside_a_step_s_list_ends_the_request_there(
    k_engine: EngineService, one_token: dict[str, RequestOutput]
) -> None:
    """The reference's 5th token as a stop token: it arrives second in the second step's list
    [t3 t4 t5]; t5 is dropped, the request stops with 5 tokens and P + 5 - 1 rows."""
    ref = one_token["greedy"].outputs[0].token_ids
    stop = ref[4]
    first = ref.index(stop)  # the stop ends the request at its first occurrence
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop])
    out = run_requests(k_engine, {"stops": (PROMPT, params)})["stops"]
    comp = out.outputs[0]
    assert comp.token_ids == ref[: first + 1]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", stop)
    _assert_rows_are_positions(out, PROMPT)


def test_blocks_computed_in_lookahead_slots_are_prefix_hits_of_the_next_turn(
    k_engine: EngineService, one_token: dict[str, RequestOutput]
) -> None:
    """Turn 2 sends prompt + turn 1's 8 tokens (18 tokens): the 4 full blocks, two of them computed
    partly from verified drafts, are hit, and their rows are still positions."""
    k_engine.kv.flush()
    turn1 = run_requests(k_engine, {"t1": (PROMPT, GREEDY)})["t1"].outputs[0].token_ids
    prompt2 = PROMPT + turn1
    out = run_requests(k_engine, {"t2": (prompt2, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))})["t2"]
    assert out.num_cached_tokens == 16
    _assert_rows_are_positions(out, prompt2)
    k_engine.kv.check_integrity()
