"""N-gram speculative decoding on CUDA gives the plain CUDA engine's greedy tokens and R3 rows.

CI has no GPU: tests/gpu/conftest.py skips these there. They run through the device tool (an H200):

    python -m pytest -m gpu tests/gpu/test_spec_cuda.py -v -s

Tiny qwen3_moe, float32, block_size 4, 12 requests side by side (repetitive prompts whose drafts are
accepted, random ones whose drafts are rejected) plus seeded sampling that must reproduce itself. The
plain engine decodes through its CUDA graphs; verify steps (q_len = k + 1) replay graphs of query
length k + 1 (worker/cuda_graph_runner.py). Float32 on a tiny model leaves no near-ties in practice; a
failure here names the request and the first differing token or row.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from fake_model import make_fake_model

from fastdeploy_r3 import LLM, SamplingParams

pytestmark = pytest.mark.gpu

R3 = {"enable_routing_replay": True}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_fake_model("qwen3_moe", str(tmp_path_factory.mktemp("qwen3-tiny")), preset="tiny", seed=0)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    reps = [[rng.randrange(3, 500) for _ in range(2 + i)] * 4 for i in range(6)]
    rnds = [[rng.randrange(3, 500) for _ in range(7 + i)] for i in range(6)]
    return reps + rnds


def _generate(model_dir: str, spec: bool, params: SamplingParams):
    with LLM(model_dir, device="cuda", dtype="float32", block_size=4, max_num_seqs=16, routing_replay_config=R3,
             speculative_config=SPEC if spec else None) as llm:
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        metrics = llm.engine.metrics()
    for o in outs:
        assert o.outputs[0].error is None, o.outputs[0].error
    return outs, metrics


def test_greedy_speculation_on_cuda_equals_the_plain_engine(model_dir: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want, _ = _generate(model_dir, False, params)
    got, m = _generate(model_dir, True, params)
    print(f"\nspec: {m['spec_draft_tokens']} drafts, {m['spec_accepted_tokens']} accepted, "
          f"{m['spec_verify_steps']} steps with drafts")
    assert 0 < m["spec_accepted_tokens"] < m["spec_draft_tokens"]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        gc, wc = g.outputs[0], w.outputs[0]
        assert gc.token_ids == wc.token_ids, f"request {i}"
        assert gc.routed_experts.shape[0] == len(g.prompt_token_ids) + len(gc.token_ids) - 1
        diff = np.flatnonzero((gc.routed_experts != wc.routed_experts).any(axis=(1, 2)))
        assert len(diff) == 0, f"request {i}: rows {diff[:5]} differ"


def test_seeded_sampled_speculation_on_cuda_reproduces_itself(model_dir: str) -> None:
    params = SamplingParams(temperature=0.8, seed=42, max_tokens=16, ignore_eos=True)
    a, _ = _generate(model_dir, True, params)
    b, _ = _generate(model_dir, True, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
