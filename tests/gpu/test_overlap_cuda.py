"""Overlap scheduling on CUDA (engine/overlap.py) gives what the synchronous engine gives: the worker
fills each placeholder from the previous step's sampled ids on the device, before the decode graph
replays (launching that step before it has finished the previous one), and stops applied one step
late publish no extra row.

CI has no GPU: tests/gpu/conftest.py skips these there. They run through the device tool (an H200):

    python -m pytest -m gpu tests/gpu/test_overlap_cuda.py -v -s

Tiny qwen3_moe, float32, block_size 4, CUDA graphs on (the default) and off; 16 requests decoding side
by side (greedy, seeded, a stop id taken from the reference run so that it stops mid-way, n = 2).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from fake_model import make_fake_model

from fastdeploy_r3 import LLM, SamplingParams

pytestmark = pytest.mark.gpu

R3 = {"enable_routing_replay": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_fake_model("qwen3_moe", str(tmp_path_factory.mktemp("qwen3-tiny")), preset="tiny", seed=0)


def _requests(stop_id: int | None) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(5 + i % 7)] for i in range(16)]
    params = []
    for i in range(16):
        if i % 4 == 0:
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True))
        elif i % 4 == 1 and stop_id is not None:
            params.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]))
        elif i == 2:
            params.append(SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=10, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=6 + i % 9, ignore_eos=True))
    return prompts, params


def _generate(model_dir: str, disable: bool, enforce_eager: bool, stop_id: int | None):
    prompts, params = _requests(stop_id)
    with LLM(model_dir, device="cuda", dtype="float32", block_size=4, max_num_seqs=16, routing_replay_config=R3,
             disable_overlap_schedule=disable, enforce_eager=enforce_eager) as llm:  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        metrics = llm.engine.metrics()
    for o in outs:
        for c in o.outputs:
            assert c.error is None, c.error
    return outs, metrics


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_overlap_on_cuda_equals_overlap_off(model_dir: str, enforce_eager: bool) -> None:
    ref, _ = _generate(model_dir, True, enforce_eager, None)
    toks = ref[1].outputs[0].token_ids
    stop_id = next(t for i, t in enumerate(toks) if i >= 3 and t not in toks[:i])  # stops request 1 mid-way
    want, m_off = _generate(model_dir, True, enforce_eager, stop_id)
    got, m_on = _generate(model_dir, False, enforce_eager, stop_id)
    print(f"\noverlap on: {m_on['overlapped_steps']} steps ahead, {m_on['sync_steps']} synchronous, "
          f"{m_on['discarded_chunks']} chunks discarded, {m_on['launched_ahead_steps']} launched by the worker "
          f"before the step before was finished; off: {m_off['sync_steps']} steps")
    assert m_off["overlapped_steps"] == 0 and m_on["overlapped_steps"] > 0
    assert m_on["launched_ahead_steps"] > 0  # CUDA's default: worker_process.StepPipeline
    assert m_on["discarded_chunks"] > 0  # the stop ids were seen one step late
    for g, w in zip(got, want, strict=True):
        for gc, wc in zip(g.outputs, w.outputs, strict=True):
            assert gc.token_ids == wc.token_ids and gc.finish_reason == wc.finish_reason
            assert gc.routed_experts.shape[0] == len(g.prompt_token_ids) + len(gc.token_ids) - 1
            assert np.array_equal(gc.routed_experts, wc.routed_experts)
    assert want[1].outputs[0].finish_reason == "stop"
