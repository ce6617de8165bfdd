"""What the engine refuses at admission (issue 11): a waiting queue past its bound (the server's 429),
a routed_experts_start past the prompt (never clamped), a request that must run on weights the engine does
not hold (a decode server's, computed by its prefill server), and, offline, a rollout id given twice or
already stored (the server's 409)."""

from __future__ import annotations

import os

import pytest

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.engine.control_error import WeightVersionError
from fastdeploy_r3.engine.scheduler import QueueFullError
from fastdeploy_r3.r3.rollout_id import RolloutIdConflictError
from fastdeploy_r3.sampling_params import InvalidRequestError

ONE = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(fake_model_dir) -> LLM:
    with LLM(fake_model_dir("qwen3_moe"), block_size=4, max_waiting_requests=2,
             routing_replay_config={"enable_routing_replay": True}) as engine:
        yield engine


def test_the_waiting_queue_is_bounded_but_an_empty_queue_takes_any_n(llm: LLM) -> None:
    eng = llm.engine
    eng.add_request("w0", [5, 6, 7], ONE)
    eng.add_request("w1", [5, 6, 8], ONE)
    with pytest.raises(QueueFullError, match="2 requests are waiting, the bound is 2"):
        eng.add_request("w2", [5, 6, 9], ONE)
    while eng.has_unfinished_requests():
        eng.step()
    eng.add_request("wide", [5, 6, 7], SamplingParams(n=3, temperature=0.0, max_tokens=2))  # 3 > 2, queue empty
    while eng.has_unfinished_requests():
        eng.step()


def test_a_request_naming_other_weights_is_refused_before_it_is_queued(llm: LLM) -> None:
    eng = llm.engine
    held = eng.weight_version
    with pytest.raises(WeightVersionError, match=f"must run on weight_version 'v-next', this engine holds '{held}'"):
        eng.add_request("other", [5, 6, 7], ONE, weight_version="v-next")
    assert not eng.has_unfinished_requests()
    eng.add_request("same", [5, 6, 7], ONE, weight_version=held)  # the held version runs as any request
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs if o.finished] == ["same"]


def test_routed_experts_start_past_the_last_prompt_row_is_refused(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="routed_experts_start=3 but the prompt has 3 tokens"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, routed_experts_start=3), use_tqdm=False)
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                      routed_experts_start=2), use_tqdm=False)
    assert out.outputs[0].routed_experts_start == 2 and out.outputs[0].routed_experts.shape[0] == 4


def test_offline_rollout_ids_are_one_per_prompt_and_never_silently_overwritten(fake_model_dir, tmp_path) -> None:
    r3 = {"enable_routing_replay": True, "routing_store_type": "local", "local_store_dir": str(tmp_path)}
    with LLM(fake_model_dir("qwen3_moe"), block_size=4, routing_replay_config=r3) as llm:
        with pytest.raises(RolloutIdConflictError, match="given twice"):
            llm.generate([[5, 6], [7, 8]], ONE, use_tqdm=False, rollout_ids=["dup", "dup"])
        llm.generate([[5, 6]], ONE, use_tqdm=False, rollout_ids=["run:0:0:0"])
        with pytest.raises(RolloutIdConflictError, match="already has routed_experts"):
            llm.generate([[7, 8]], ONE, use_tqdm=False, rollout_ids=["run:0:0:0"])
        llm.generate([[7, 8]], ONE, use_tqdm=False, rollout_ids=["run:0:0:0"], overwrite_rollouts=True)
        first = llm.generate([[9]], ONE, use_tqdm=False)[0].request_id
    with LLM(fake_model_dir("qwen3_moe"), block_size=4, routing_replay_config=r3) as llm:
        second = llm.generate([[9]], ONE, use_tqdm=False)[0].request_id
    # id-less prompts of two runs on one store: two keys, not one overwritten
    assert first != second
    assert {f"{first}.npy", f"{second}.npy", "run:0:0:0.npy"} <= set(os.listdir(tmp_path))
