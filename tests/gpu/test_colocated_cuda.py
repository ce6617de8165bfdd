"""Colocated training on CUDA (the lead runs these on an H200; CI skips them, tests/gpu/conftest.py):

- /update_weights_from_tensor through CUDA IPC handles (this test process is the trainer: its tensors
  live on the same GPU, the worker maps them, nothing goes through the host) gives the tokens and R3
  of a fresh engine on the new weights;
- /release_memory_occupation makes torch.cuda.memory_allocated in the worker drop by at least the KV
  cache and weight bytes, /resume_memory_occupation brings them back, and after a push the server
  serves again.

    python -m pytest -m gpu tests/gpu/test_colocated_cuda.py -v
"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
from api_server_process import ServerHandle, api_server
from safetensors.torch import load_file

from fastdeploy_r3.client.tensor_transport import serialize_named_tensors
from fastdeploy_r3.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

NUM_BLOCKS, PROMPT = 64, list(range(40, 90))
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(fake_model_dir, tmp_path_factory) -> Iterator[ServerHandle]:
    with api_server(fake_model_dir("qwen3_moe", seed=0), str(tmp_path_factory.mktemp("logs")), "--device", "cuda",
                    "--routing-replay-config", '{"enable_routing_replay": true}', "--max-model-len", "256",
                    "--num-gpu-blocks-override", str(NUM_BLOCKS)) as handle:
        yield handle


def _rollout(server: ServerHandle) -> tuple[list[int], np.ndarray]:
    r = httpx.post(f"{server.url}/generate", timeout=120,
                   json={"input_ids": PROMPT, "sampling_params": GREEDY, "return_routed_experts": True})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    return r.json()["output_ids"], rows


def _fresh(model_dir: str) -> tuple[list[int], np.ndarray]:
    from fastdeploy_r3.engine.llm import LLM

    with LLM(model_dir, device="cuda", max_model_len=256, routing_replay_config={"enable_routing_replay": True}) \
            as llm:
        (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return out.outputs[0].token_ids, out.outputs[0].routed_experts.astype(np.int32).reshape(-1)


def _push_cuda(server: ServerHandle, model_dir: str, version: str) -> None:
    tensors = [(k, v.to("cuda")) for k, v in sorted(load_file(f"{model_dir}/model.safetensors").items())]
    r = httpx.post(f"{server.url}/update_weights_from_tensor", timeout=120,
                   json={"serialized_named_tensors": [serialize_named_tensors(tensors)], "weight_version": version})
    assert r.status_code == 200, r.text
    torch.cuda.synchronize()
    del tensors
    torch.cuda.ipc_collect()


def test_update_from_tensor_over_cuda_ipc_serves_the_new_weights(server: ServerHandle, fake_model_dir) -> None:
    new = fake_model_dir("qwen3_moe", seed=1)
    _push_cuda(server, new, "ipc-1")
    tokens, rows = _rollout(server)
    want_tokens, want_rows = _fresh(new)
    assert tokens == want_tokens and np.array_equal(rows, want_rows)


def test_release_frees_kv_and_weight_bytes_and_resume_brings_them_back(server: ServerHandle, fake_model_dir) -> None:
    from fastdeploy_r3.config import ModelConfig
    from fastdeploy_r3.model_executor.model_loader import load_model

    model = load_model(ModelConfig(model=fake_model_dir("qwen3_moe", seed=0)), torch.device("cpu"))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_block = model.num_layers * 2 * 16 * model.num_kv_heads * model.head_dim * 4  # float32, block 16
    kv_bytes = NUM_BLOCKS * kv_per_block
    r = httpx.post(f"{server.url}/release_memory_occupation", json={"tags": None}, timeout=120)
    assert r.status_code == 200, r.text
    (rank,) = r.json()["ranks"]
    assert rank["memory_allocated_before"] - rank["memory_allocated_after"] >= kv_bytes + weight_bytes
    r = httpx.post(f"{server.url}/resume_memory_occupation", json={"tags": None}, timeout=120)
    (rank,) = r.json()["ranks"]
    assert rank["memory_allocated_after"] - rank["memory_allocated_before"] >= kv_bytes + weight_bytes
    new = fake_model_dir("qwen3_moe", seed=2)
    _push_cuda(server, new, "resumed-2")
    tokens, rows = _rollout(server)
    want_tokens, want_rows = _fresh(new)
    assert tokens == want_tokens and np.array_equal(rows, want_rows)
