"""Prefill/decode disaggregation on one GPU (docs/pd.md): P, D and a colocated server share the
device, sglang-router in PD mode in front of P and D; once with the store backend (a redis-server as
the shared KV store), once with the mooncake backend (each its own file store, blocks over Mooncake
Transfer Engine on loopback TCP). Greedy tokens and R3 through PD equal the colocated server's bit for
bit, streamed and not; D loads every prompt block P stored (the partial last one too), with the mooncake
backend straight into its engine's device blocks (through its cache transfer manager's landing buffer),
never through its own store (the lead runs this on an H200; CI skips it, tests/gpu/conftest.py):

    python -m pytest -m gpu tests/gpu/test_pd_cuda.py -v
"""

from __future__ import annotations

import base64
import glob
import os
from collections.abc import Iterator

import numpy as np
import pytest
from pd_deployment import Deployment, generate_greedy, pd_deployment

pytestmark = pytest.mark.gpu

BLOCK = 16
NUM_LAYERS, TOP_K = 4, 4  # the fake glm4_moe
PREFIX = list(range(100, 148))  # three full blocks shared by every prompt
PROMPTS = [PREFIX + list(range(300 + 10 * i, 300 + 10 * i + k)) for i, k in enumerate((0, 1, 9, 16, 23))]


@pytest.fixture(scope="module", params=["store", "mooncake"])
def pd(fake_model_dir, tmp_path_factory, request) -> Iterator[Deployment]:
    common = ("--device", "cuda", "--routing-replay-config", '{"enable_routing_replay": true}',
              "--enable-return-routed-experts", "--max-model-len", "512", "--block-size", str(BLOCK),
              "--num-gpu-blocks-override", "256", "--gpu-memory-utilization", "0.25")  # three servers, one GPU
    with pd_deployment(fake_model_dir("glm4_moe"), str(tmp_path_factory.mktemp("pd_cuda_logs")), common,
                       timeout=600, backend=request.param) as deployment:
        yield deployment


def _rows(out: dict, prompt: list[int]) -> np.ndarray:
    rows = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
    return rows.reshape(len(prompt) + len(out["output_ids"]) - 1, NUM_LAYERS, TOP_K)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_pd_on_one_gpu_equals_colocated_tokens_and_r3(pd: Deployment, stream: bool) -> None:
    for prompt in PROMPTS:
        out = generate_greedy(pd.router, prompt, 12, stream, timeout=300)
        ref = generate_greedy(pd.colocated.url, prompt, 12, stream, timeout=300)
        assert out["output_ids"] == ref["output_ids"] and len(out["output_ids"]) == 12
        assert np.array_equal(_rows(out, prompt), _rows(ref, prompt))
        if not stream:
            assert out["meta_info"]["cached_tokens"] == len(prompt)  # the partial last block arrived too
    if not pd.store_url:  # mooncake: each server has its own file store; D's holds none of P's blocks
        p_blocks, d_blocks = ({os.path.basename(b) for b in glob.glob(os.path.join(pd.log_dir, f"{side}_store", "**",
                                                                                    "*"), recursive=True)
                               if os.path.isfile(b)} for side in ("p", "d"))  # fmt: skip
        assert len(p_blocks) >= 3 and not p_blocks & d_blocks
