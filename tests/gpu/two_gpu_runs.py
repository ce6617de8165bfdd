"""What the two-GPU tests (test_tp_cuda.py, test_ep_cuda.py) run: 12 greedy requests over three shared
24-token prefixes on a tiny float32 model, TP ranks on CUDA devices, R3 on; tokens and rows per request."""

from __future__ import annotations

import random

import numpy as np

from fastdeploy_r3 import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
R3 = {"enable_routing_replay": True}


def prompts(seed: int) -> list[list[int]]:
    """Three 24-token prefixes, each reused by several requests with different tails."""
    rng = random.Random(seed)
    bases = [[rng.randrange(3, 500) for _ in range(24)] for _ in range(3)]
    return [bases[i % 3] + [rng.randrange(3, 500) for _ in range(1 + i % 5)] for i in range(12)]


def run(model_dir: str, tp: int, seed: int, **kw: object) -> tuple[list[list[int]], list[np.ndarray]]:
    with LLM(model_dir, device="cuda", dtype="float32", tensor_parallel_size=tp, block_size=4, max_num_seqs=4,
             num_gpu_blocks_override=256, routing_replay_config=R3, **kw) as llm:  # fmt: skip
        outs = llm.generate(prompts(seed), GREEDY, use_tqdm=False)
    for o in outs:
        assert o.outputs[0].error is None, o.outputs[0].error
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].routed_experts for o in outs]
