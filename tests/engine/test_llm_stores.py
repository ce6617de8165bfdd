"""Offline LLM with a local or p2pstore routing store: R3 lands under the rollout ids, readable by the
trainer client, equal to what generate() returned."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.client import read_local_rollout, read_redis_rollout
from fastdeploy_r3.r3.rollout_id import InvalidRolloutIdError

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]


@pytest.fixture(scope="module")
def model_dir(fake_model_dir: Callable[..., str]) -> str:
    return fake_model_dir("glm4_moe")


def test_local_store_per_layer_files_with_two_choices(model_dir: str, tmp_path) -> None:
    """GLM (MoE layers 1..3), per-layer files, n=2: rollout 'data:0:1:0' holds both choices, layer by layer."""
    r3 = {"enable_routing_replay": True, "routing_store_type": "local", "local_store_dir": str(tmp_path),
          "use_fused_put": False}
    with LLM(model_dir, block_size=4, routing_replay_config=r3) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(n=2, seed=3, max_tokens=4), use_tqdm=False,
                            rollout_ids=["data:0:1:0", "data:1:1:0"])
    assert outs[0].moe_layer_ids == [1, 2, 3]
    for out, rid in zip(outs, ["data:0:1:0", "data:1:1:0"]):
        for c in out.outputs:
            assert (tmp_path / f"{rid}_{c.index}" / "layer_2.npy").is_file()
            got = read_local_rollout(str(tmp_path), rid, choice=c.index, moe_layer_ids=[1, 2, 3])
            assert got.dtype == np.uint8 and np.array_equal(got, c.routed_experts)


def test_p2pstore_keys_default_to_request_ids(model_dir: str, redis_url: str) -> None:
    """Redis, fused put, no rollout ids given: each prompt's R3 is stored under its request id."""
    r3 = {"enable_routing_replay": True, "routing_store_type": "p2pstore", "p2pstore_url": redis_url, "ttl_s": 60}
    with LLM(model_dir, block_size=4, routing_replay_config=r3, r3_namespace="offline-test") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        with pytest.raises(InvalidRolloutIdError):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1), use_tqdm=False, rollout_ids=["../x"])
    for out in outs:
        got = read_redis_rollout(redis_url, "offline-test", out.request_id)
        assert np.array_equal(got, out.outputs[0].routed_experts)


def test_a_failed_put_fails_the_prompt_instead_of_storing_nothing(model_dir: str) -> None:
    """No Redis listens on port 1: generate() still returns, and every prompt comes back failed, saying why."""
    r3 = {"enable_routing_replay": True, "routing_store_type": "p2pstore", "p2pstore_url": "redis://127.0.0.1:1/0"}
    with LLM(model_dir, block_size=4, routing_replay_config=r3) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        opted_out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, return_routed_experts=False),
                                 use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "error" and c.routed_experts is None
        assert c.error.startswith("R3DeliveryError: storing routed_experts of rollout 'offline-")
    assert opted_out[0].outputs[0].finish_reason == "length"  # nothing asked, nothing stored, no failure
