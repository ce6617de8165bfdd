"""Trainer-side decoding and Megatron layout of R3 payloads."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from fastdeploy_r3.client import (
    RoutedExpertsDecodeError,
    decode_routed_experts,
    encode_routed_experts,
    to_megatron_router_replay,
)


def test_encode_decode_round_trip_keeps_dtype_and_shape() -> None:
    for dtype in (np.uint8, np.uint16, np.int32):
        arr = np.arange(5 * 3 * 2, dtype=dtype).reshape(5, 3, 2)  # [rows, L, K]
        out = decode_routed_experts(encode_routed_experts(arr))
        assert out.dtype == dtype and np.array_equal(out, arr)


def test_decode_rejects_garbage() -> None:
    with pytest.raises(RoutedExpertsDecodeError):
        decode_routed_experts("not base64!!")
    with pytest.raises(RoutedExpertsDecodeError):
        decode_routed_experts(base64.b64encode(b"hello").decode())
    with pytest.raises(RoutedExpertsDecodeError):  # float arrays are not expert ids
        decode_routed_experts(encode_routed_experts(np.zeros((2, 1, 1), dtype=np.float32)))


def test_megatron_layout_pads_last_row_with_distinct_ids() -> None:
    arr = np.array([[[5, 6], [7, 1]], [[2, 3], [4, 0]]], dtype=np.uint8)  # [T-1=2, L=2, K=2]
    per_layer = to_megatron_router_replay(arr, moe_layer_ids=[1, 3])
    assert len(per_layer) == 2
    assert per_layer[0].dtype == torch.int64 and per_layer[0].tolist() == [[5, 6], [2, 3], [0, 1]]
    assert per_layer[1].tolist() == [[7, 1], [4, 0], [0, 1]]


def test_megatron_layout_refuses_sentinel_and_wrong_layers() -> None:
    arr = np.zeros((3, 2, 2), dtype=np.uint8)
    arr[1, 1, 0] = 255
    with pytest.raises(ValueError, match="row 1 layer 3"):
        to_megatron_router_replay(arr, moe_layer_ids=[1, 3])
    with pytest.raises(ValueError, match="expected"):
        to_megatron_router_replay(np.zeros((3, 2, 2), dtype=np.uint8), moe_layer_ids=[1])


# -- against the real server in local-store mode ------------------------------------------------------


@pytest.fixture(scope="module")
def local_server(tmp_path_factory):
    import json

    from api_server_process import api_server
    from fake_model import make_fake_model

    model_dir = make_fake_model("qwen3_moe", str(tmp_path_factory.mktemp("qwen")))
    store_dir = str(tmp_path_factory.mktemp("r3store"))
    cfg = {"enable_routing_replay": True, "routing_store_type": "local", "local_store_dir": store_dir}
    with api_server(model_dir, str(tmp_path_factory.mktemp("logs")), "--routing-replay-config", json.dumps(cfg)) as h:
        yield h, store_dir


def test_trainer_reads_local_rollout_and_lays_it_out_for_megatron(local_server) -> None:
    import openai

    from fastdeploy_r3.client import read_local_rollout

    server, store_dir = local_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0]
    layers = model.r3["moe_layer_ids"]
    resp = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "route me"}],
                                          max_tokens=5, temperature=0, extra_body={"rollout_id": "run1:0:0:0"})
    p, n = resp.usage.prompt_tokens, resp.usage.completion_tokens
    arr = read_local_rollout(store_dir, "run1:0:0:0")  # [T-1, L, K]
    assert arr.shape == (p + n - 1, len(layers), model.r3["moe_top_k"])
    per_layer = to_megatron_router_replay(arr, layers)
    assert len(per_layer) == len(layers) and per_layer[0].shape == (p + n, model.r3["moe_top_k"])


def test_failed_local_put_fails_the_request_and_server_recovers(local_server) -> None:
    import os
    import shutil

    import openai

    server, store_dir = local_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    shutil.rmtree(store_dir)
    with open(store_dir, "w") as f:  # the store directory is now a file: every put fails
        f.write("not a directory")
    try:
        # the store takes the rollout id before the request runs: that write fails first
        with pytest.raises(openai.InternalServerError, match="R3 store could not reserve rollout 'lost'"):
            client.completions.create(model=model, prompt="lost", max_tokens=2, extra_body={"rollout_id": "lost"})
    finally:
        os.unlink(store_dir)
    client.completions.create(model=model, prompt="found", max_tokens=2, extra_body={"rollout_id": "found"})
    assert os.path.isfile(os.path.join(store_dir, "found.npy"))
