"""GLM MTP speculative decoding on CUDA gives the plain CUDA engine's greedy tokens and R3 rows.

CI has no GPU: tests/gpu/conftest.py skips these there. They run through the device tool (an H200):

    python -m pytest -m gpu tests/gpu/test_spec_mtp_cuda.py -v -s

First, one verify step of the fake GLM with a draft layer in a StepBench: through the verify graph of
query length 4 and eagerly, from the same draft state, it gives the same tokens and the same drafts.

The one-layer GLM written by transformers whose draft layer copies the policy (tests/hf_checkpoints.py),
float32, block_size 4, 8 requests side by side. Both engines replay their CUDA graphs (the MTP engine's
verify graphs of query length k + 1 hand the drafter their hidden states, DecodeGraphs.hidden_of), and the
MTP engine runs its draft layer after every step (worker/mtp_drafter.py); a third run with
enforce_eager=True checks graphs on against graphs off. R3 rows are the policy's one MoE layer, P + N - 1
per request, equal to the plain engine's; a failure names the request and the first differing rows.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
from fake_model import make_fake_model
from hf_checkpoints import write_glm_checkpoint_drafting_like_its_policy
from step_bench import StepBench
from verify_graph_cases import verify_step_after_prefill

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.worker.messages import StepInput

pytestmark = pytest.mark.gpu

R3 = {"enable_routing_replay": True}
MTP = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_glm_checkpoint_drafting_like_its_policy(str(tmp_path_factory.mktemp("glm-mtp")))


def test_drafts_after_a_verify_graph_equal_the_eager_ones(tmp_path_factory: pytest.TempPathFactory) -> None:
    model = make_fake_model("glm4_moe", str(tmp_path_factory.mktemp("glm-fake")), draft_layer=True)
    sb = StepBench(model, "cuda", "float32", "auto", 4, 64, 64, 4, 256, False, speculative_config=MTP)
    try:
        sb.runner.capture_decode_graphs(verify_query_len=4)
        graphs, drafter = sb.runner.decode_graphs, sb.runner.drafter
        assert graphs is not None and 4 in graphs.query_sizes and drafter is not None
        step, _ = verify_step_after_prefill(sb)  # its probe decode step replays the q = 1 graph
        states, free = copy.deepcopy(drafter._states), list(drafter._free)
        sb.runner.decode_graphs = None
        want = sb.runner.execute(StepInput(1000, step))
        drafter._states, drafter._free = states, free  # the draft state the eager step started from
        sb.runner.decode_graphs = graphs
        got = sb.runner.execute(StepInput(1001, step))
        print(f"\nreplays by query length: {graphs.replays}; tokens {got.sampled_token_ids}, "
              f"drafts {got.draft_token_ids}")
        assert graphs.replays[4] == 1 and graphs.replays[1] == 1
        assert got.error is None and got.sampled_token_ids == want.sampled_token_ids
        assert got.draft_token_ids == want.draft_token_ids
        assert sorted(got.draft_token_ids) == ["r0", "r1", "r2"] and all(
            len(d) == 3 for d in got.draft_token_ids.values())
    finally:
        sb.close()


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(0, 256) for _ in range(7 + 3 * i)] for i in range(8)]


def _generate(model_dir: str, spec: bool, params: SamplingParams, eager: bool = False):
    with LLM(model_dir, device="cuda", dtype="float32", block_size=4, max_num_seqs=16, routing_replay_config=R3,
             speculative_config=MTP if spec else None, enforce_eager=eager) as llm:
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        metrics = llm.engine.metrics()
    for o in outs:
        assert o.outputs[0].error is None, o.outputs[0].error
    return outs, metrics


def test_greedy_mtp_on_cuda_equals_the_plain_engine_under_graphs(model_dir: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want, _ = _generate(model_dir, False, params)
    got, m = _generate(model_dir, True, params)
    eager, m_eager = _generate(model_dir, True, params, eager=True)
    print(f"\nmtp: {m['spec_draft_tokens']} drafts, {m['spec_accepted_tokens']} accepted; eager: "
          f"{m_eager['spec_draft_tokens']} drafts, {m_eager['spec_accepted_tokens']} accepted")
    assert m["spec_accepted_tokens"] > 0 and m_eager["spec_accepted_tokens"] > 0
    for i, (g, w) in enumerate(zip(got + eager, want + want, strict=True)):
        gc, wc = g.outputs[0], w.outputs[0]
        assert gc.token_ids == wc.token_ids, f"request {i}"
        assert gc.routed_experts.shape == (len(g.prompt_token_ids) + len(gc.token_ids) - 1, 1, 4)
        diff = np.flatnonzero((gc.routed_experts != wc.routed_experts).any(axis=(1, 2)))
        assert len(diff) == 0, f"request {i}: rows {diff[:5]} differ"
