"""GLM MTP speculative decoding on CUDA gives the plain CUDA engine's greedy tokens and R3 rows.

CI has no GPU: tests/gpu/conftest.py skips these there. They run through the device tool (an H200):

    python -m pytest -m gpu tests/gpu/test_spec_mtp_cuda.py -v -s

The one-layer GLM written by transformers whose draft layer copies the policy (tests/hf_checkpoints.py),
float32, block_size 4, 8 requests side by side. The plain engine decodes through its CUDA graphs; the MTP
engine verifies eagerly (Triton paged attention, fused routing) and runs its draft layer after every
step (worker/mtp_drafter.py). R3 rows are the policy's one MoE layer, P + N - 1 per request, equal to the
plain engine's; a failure names the request and the first differing rows.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hf_checkpoints import write_glm_checkpoint_drafting_like_its_policy

from fastdeploy_r3 import LLM, SamplingParams

pytestmark = pytest.mark.gpu

R3 = {"enable_routing_replay": True}
MTP = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_glm_checkpoint_drafting_like_its_policy(str(tmp_path_factory.mktemp("glm-mtp")))


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(0, 256) for _ in range(7 + 3 * i)] for i in range(8)]


def _generate(model_dir: str, spec: bool, params: SamplingParams):
    with LLM(model_dir, device="cuda", dtype="float32", block_size=4, max_num_seqs=16, routing_replay_config=R3,
             speculative_config=MTP if spec else None) as llm:
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        metrics = llm.engine.metrics()
    for o in outs:
        assert o.outputs[0].error is None, o.outputs[0].error
    return outs, metrics


def test_greedy_mtp_on_cuda_equals_the_plain_engine_under_graphs(model_dir: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want, _ = _generate(model_dir, False, params)
    got, m = _generate(model_dir, True, params)
    print(f"\nmtp: {m['spec_draft_tokens']} drafts, {m['spec_accepted_tokens']} accepted")
    assert m["spec_accepted_tokens"] > 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        gc, wc = g.outputs[0], w.outputs[0]
        assert gc.token_ids == wc.token_ids, f"request {i}"
        assert gc.routed_experts.shape == (len(g.prompt_token_ids) + len(gc.token_ids) - 1, 1, 4)
        diff = np.flatnonzero((gc.routed_experts != wc.routed_experts).any(axis=(1, 2)))
        assert len(diff) == 0, f"request {i}: rows {diff[:5]} differ"


def test_seeded_sampled_mtp_on_cuda_reproduces_itself(model_dir: str) -> None:
    params = SamplingParams(temperature=0.8, seed=42, max_tokens=16, ignore_eos=True)
    a, _ = _generate(model_dir, True, params)
    b, _ = _generate(model_dir, True, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
