"""R3 at the trainer boundary: numpy, torch and Paddle tensors of the same ids, from a server's responses
and from its Mooncake p2pstore (FastDeploy keys, per layer)."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest
import torch

from fastdeploy_r3.client import as_tensor, decode_routed_experts, read_mooncake_rollout


def _paddle():
    try:
        import paddle
    except ImportError as e:
        pytest.skip(f"PaddlePaddle cannot be imported here ({e}); `make paddle` installs it where a wheel exists")
    return paddle


def test_uint8_ids_are_widened_to_int32_in_every_framework() -> None:
    paddle = _paddle()
    ids = np.array([[[5, 6], [7, 1]], [[2, 3], [4, 0]]], dtype=np.uint8)  # [rows=2, L=2, K=2]
    as_np, as_torch, as_paddle = (as_tensor(ids, f) for f in ("numpy", "torch", "paddle"))
    assert as_np.dtype == np.int32 and as_torch.dtype == torch.int32 and as_paddle.dtype == paddle.int32
    assert as_np.tolist() == as_torch.tolist() == as_paddle.numpy().tolist() == ids.tolist()


def test_int64_ids_are_shared_not_copied() -> None:
    paddle = _paddle()
    ids = np.arange(12, dtype=np.int64).reshape(3, 2, 2)  # [rows, L, K]
    as_paddle, as_torch = as_tensor(ids, "paddle"), as_tensor(ids, "torch")
    ids[0, 0, 0] = 41
    assert int(as_paddle[0, 0, 0]) == 41 and int(as_torch[0, 0, 0]) == 41
    assert as_paddle.dtype == paddle.int64


def test_sentinel_and_unknown_framework_are_refused() -> None:
    ids = np.zeros((3, 2, 2), dtype=np.uint8)
    ids[2, 1, 0] = 255  # no route recorded: widening would make it look like expert 255
    with pytest.raises(ValueError, match=r"position \(2, 1, 0\) holds the no-route sentinel"):
        as_tensor(ids, "paddle")
    with pytest.raises(ValueError, match="use one of"):
        as_tensor(ids[:2], "jax")


def _replay_gate(paddle, logits: np.ndarray, ids) -> np.ndarray:
    """What a Paddle trainer does with replayed ids: gather the router's probabilities of those experts."""
    probs = paddle.nn.functional.softmax(paddle.to_tensor(logits), axis=-1)  # [T, E]
    return paddle.take_along_axis(probs, ids, axis=1).numpy()  # [T, K]


# -- against real servers: responses and a Mooncake p2pstore ------------------------------------------------


@pytest.fixture(scope="module")
def servers(fake_model_dir: Callable[..., str], mooncake_store_url: str, tmp_path_factory):
    from api_server_process import api_servers

    model_dir = fake_model_dir("glm4_moe")
    p2p = {"enable_routing_replay": True, "routing_store_type": "p2pstore", "use_fused_put": False,
           "p2pstore_url": mooncake_store_url + "&key_style=fastdeploy"}  # fmt: skip
    logs = str(tmp_path_factory.mktemp("logs"))
    with api_servers(logs, (model_dir, "--routing-replay-config", '{"enable_routing_replay": true}'),
                     (model_dir, "--routing-replay-config", json.dumps(p2p))) as (response, store):
        yield response, store, p2p["p2pstore_url"]


def test_paddle_program_gets_the_ids_of_the_numpy_path_from_responses_and_mooncake(servers) -> None:
    """The same greedy request on a response-mode server and on a Mooncake p2pstore server: the Paddle
    tensors equal the numpy arrays, both deliveries carry the same ids, and a Paddle gather on them
    equals numpy's."""
    import openai

    paddle = _paddle()
    response_server, store_server, url = servers
    by_response = openai.OpenAI(base_url=f"{response_server.url}/v1", api_key="none", max_retries=0)
    by_store = openai.OpenAI(base_url=f"{store_server.url}/v1", api_key="none", max_retries=0)
    card = by_store.models.list().data[0]
    layers, k, e = card.r3["moe_layer_ids"], card.r3["moe_top_k"], card.r3["num_experts"]
    assert card.r3["namespace"] is None  # FastDeploy keys carry no namespace
    kw = {"model": card.id, "prompt": "replay these experts", "max_tokens": 5, "temperature": 0}
    inline = by_response.completions.create(**kw, extra_body={"ignore_eos": True})
    stored = by_store.completions.create(**kw, extra_body={"rollout_id": "paddle:0:0:0", "ignore_eos": True})
    assert stored.choices[0].routed_experts is None

    numpy_inline = decode_routed_experts(inline.choices[0].routed_experts)  # [T-1, L, K]
    numpy_stored = read_mooncake_rollout(url, "unused", "paddle:0:0:0", moe_layer_ids=layers)
    rows = inline.usage.prompt_tokens + inline.usage.completion_tokens - 1
    assert numpy_inline.shape == numpy_stored.shape == (rows, len(layers), k)
    assert np.array_equal(numpy_inline, numpy_stored)

    logits = np.random.default_rng(0).standard_normal((rows, e)).astype(np.float32)  # [T-1, E]
    for arr in (numpy_inline, numpy_stored):
        as_paddle = as_tensor(arr, "paddle")  # [T-1, L, K] int32
        assert as_paddle.dtype == paddle.int32 and np.array_equal(as_paddle.numpy(), arr)
        for j in range(len(layers)):
            got = _replay_gate(paddle, logits, as_paddle[:, j, :])  # [T-1, K]
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            want = np.take_along_axis(probs, arr[:, j, :].astype(np.int64), axis=1)
            np.testing.assert_allclose(got, want, rtol=1e-6)
