"""The real API server (subprocess, real engine, fake GLM-4.5 checkpoint with a dense layer 0) driven by
the official `openai` client: R3 arrives in every response shape, bad input gets the right error and
the server keeps serving. (A dead engine: tests/reliability/test_fault_matrix.py.)"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from api_server_process import ServerHandle, api_server, free_port, server_command, server_env
from fake_model import make_fake_model

from fastdeploy_r3.client import decode_routed_experts

API_KEY = "test-key-123"
MOE_LAYER_IDS = [1, 2, 3]  # glm4_moe tiny: 4 layers, first_k_dense_replace=1
TOP_K = 4
R3_ON = '{"enable_routing_replay": true}'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_fake_model("glm4_moe", str(tmp_path_factory.mktemp("glm")))


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory) -> Iterator[ServerHandle]:
    logs = str(tmp_path_factory.mktemp("logs"))
    with api_server(model_dir, logs, "--routing-replay-config", R3_ON, "--api-key", API_KEY,
                    "--served-model-name", "tiny-glm", "--max-model-len", "128") as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _r3(choice) -> np.ndarray:
    return decode_routed_experts(choice.routed_experts)


def _check_r3(arr: np.ndarray, p: int, n: int) -> None:
    assert arr.shape == (p + n - 1, len(MOE_LAYER_IDS), TOP_K)
    assert arr.dtype == np.uint8 and int(arr.max()) < 16


def test_completion_carries_r3_of_prompt_and_completion(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="tiny-glm", prompt="the quick brown fox", max_tokens=5, temperature=0)
    choice = resp.choices[0]
    _check_r3(_r3(choice), resp.usage.prompt_tokens, resp.usage.completion_tokens)
    assert choice.routed_experts_start == 0
    assert resp.moe_layer_ids == MOE_LAYER_IDS


def test_chat_streaming_r3_equals_non_streaming(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    full = client.chat.completions.create(model="tiny-glm", messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
    _check_r3(_r3(full.choices[0]), full.usage.prompt_tokens, full.usage.completion_tokens)

    chunks = list(client.chat.completions.create(model="tiny-glm", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and text == full.choices[0].message.content
    assert finals[0].moe_layer_ids == MOE_LAYER_IDS
    assert chunks[-1].usage.completion_tokens == 6
    assert np.array_equal(_r3(finals[0].choices[0]), _r3(full.choices[0]))


def _streamed_texts(chunks) -> dict[int, str]:
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.text or "")
    return texts


def test_multi_byte_characters_split_across_tokens_stream_whole(client: openai.OpenAI, model_dir: str) -> None:
    """The fake tokenizer spells every non-ASCII character with 2-4 byte tokens. 6 sampled choices
    of 40 tokens contain such characters; streamed, each choice's text equals the non-streamed text
    (no "\ufffd" sent for a half character and then contradicted)."""
    from fastdeploy_r3.engine.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    kw = dict(model="tiny-glm", prompt="Hello", max_tokens=40, n=6, temperature=1.0, seed=0,
              extra_body={"ignore_eos": True, "return_routed_experts": False})
    full = {c.index: c.text for c in client.completions.create(**kw).choices}
    streamed = _streamed_texts(client.completions.create(**kw, stream=True))
    assert sorted(streamed) == list(range(6)) and streamed == full
    split = {ch for text in full.values() for ch in text if ord(ch) > 127 and ch != "\ufffd"}
    assert split, "no choice holds a multi-byte character; pick another seed"
    assert all(len(tok.encode(ch)) >= 2 for ch in split)  # each of them was split across tokens


def test_stop_string_cuts_streamed_text_as_non_streamed(client: openai.OpenAI) -> None:
    """A stop string taken from the middle of the greedy text: streamed and non-streamed texts both end
    right before it, although the engine saw the stop string arrive over several deltas."""
    kw = dict(model="tiny-glm", prompt="the quick brown fox", max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True, "return_routed_experts": False})
    text = client.completions.create(**kw).choices[0].text
    assert len(text) >= 12, text
    stop = text[8:11]
    want = text[: text.index(stop)]
    cut = client.completions.create(**kw, stop=[stop]).choices[0]
    assert cut.text == want and cut.finish_reason == "stop"
    chunks = list(client.completions.create(**kw, stop=[stop], stream=True))
    assert _streamed_texts(chunks) == {0: want}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_n2_each_choice_has_its_own_r3(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="tiny-glm", prompt="abc abc", max_tokens=4, n=2, temperature=1.0, seed=7,
                                     extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1]
    for c in resp.choices:
        _check_r3(_r3(c), resp.usage.prompt_tokens, 4)
    chunks = list(client.completions.create(model="tiny-glm", prompt="abc abc", max_tokens=4, n=2, temperature=1.0,
                                            seed=7, stream=True, extra_body={"ignore_eos": True}))
    finals = {c.choices[0].index: c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason}
    assert sorted(finals) == [0, 1]
    for i, c in finals.items():  # same seed, same tokens, same routing
        assert np.array_equal(_r3(c), _r3(resp.choices[i]))


def test_routed_experts_start_and_opt_out(client: openai.OpenAI) -> None:
    base = dict(model="tiny-glm", prompt="multi turn rollout", max_tokens=3, temperature=0)
    full = _r3(client.completions.create(**base).choices[0])
    part = client.completions.create(**base, extra_body={"routed_experts_start": 5}).choices[0]
    assert part.routed_experts_start == 5 and np.array_equal(_r3(part), full[5:])
    off = client.completions.create(**base, extra_body={"return_routed_experts": False})
    assert off.choices[0].routed_experts is None and off.moe_layer_ids is None


def test_token_id_prompt_stop_and_stop_token_ids(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="tiny-glm", prompt=[20, 21, 22, 23], max_tokens=8, temperature=0)
    p, n = resp.usage.prompt_tokens, resp.usage.completion_tokens
    assert p == 4
    _check_r3(_r3(resp.choices[0]), p, n)
    first = resp.choices[0].text
    if first:
        stopped = client.completions.create(model="tiny-glm", prompt=[20, 21, 22, 23], max_tokens=8, temperature=0,
                                            stop=[first[-1]])
        assert stopped.choices[0].finish_reason == "stop"
        _check_r3(_r3(stopped.choices[0]), p, stopped.usage.completion_tokens)


def _assert_error(r: httpx.Response, status: int, words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and words in err["message"], err


def test_bad_inputs_get_openai_errors_and_server_keeps_serving(server: ServerHandle, client: openai.OpenAI) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{server.url}/v1/completions"
    with pytest.raises(openai.BadRequestError, match="rollout_id"):
        client.completions.create(model="tiny-glm", prompt="x", max_tokens=1, extra_body={"rollout_id": "../etc"})
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model="tiny-glm", prompt=list(range(20, 160)), max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    json_auth = {**auth, "Content-Type": "application/json"}
    _assert_error(httpx.post(url, content=b'{"prompt": "x", ', headers=json_auth), 400, "not valid JSON")
    _assert_error(httpx.post(url, content=b"prompt=x", headers=auth), 400, "JSON object")
    _assert_error(httpx.post(url, json={"prompt": "x", "temperature": -1}, headers=auth), 400, "temperature")
    _assert_error(httpx.post(url, json={"prompt": "x", "bogus_field": 1}, headers=auth), 400, "bogus_field")
    _assert_error(httpx.post(url, json={"prompt": "x"}), 401, "API key")
    # a stream that is refused still gets its status code
    _assert_error(httpx.post(url, json={"prompt": "x", "stream": True, "rollout_id": "a/b"}, headers=auth), 400,
                  "rollout_id")
    ok = client.completions.create(model="tiny-glm", prompt="still alive", max_tokens=2, temperature=0)
    _check_r3(_r3(ok.choices[0]), ok.usage.prompt_tokens, ok.usage.completion_tokens)


def test_models_health_and_metrics(server: ServerHandle, client: openai.OpenAI) -> None:
    card = client.models.list().data[0]
    assert card.id == "tiny-glm"
    assert card.r3["moe_layer_ids"] == MOE_LAYER_IDS and card.r3["num_experts"] == 16
    assert card.r3["routing_dtype"] == "uint8"
    assert httpx.get(f"{server.url}/health").status_code == 401  # behind the API key, as /v1 is
    assert httpx.get(f"{server.url}/health", headers={"Authorization": f"Bearer {API_KEY}"}).json() == {
        "status": "ok", "engine": "ok", "paused": None}
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values["fastdeploy_r3_engine_r3_rows_delivered_total"] > 0
    assert values["fastdeploy_r3_engine_r3_bytes_total"] > 0
    for name in ("r3_failures_total", "r3_gather_seconds_total", "swap_out_blocks_total", "swap_in_blocks_total",
                 "prefix_hit_blocks_total"):
        assert f"fastdeploy_r3_engine_{name}" in values
    # the step counters tools/bench_rollout.py reads: the requests above ran model steps, and the
    # step's wall time is its parts' sum
    e = {name.removeprefix("fastdeploy_r3_engine_"): v for name, v in values.items()}
    # (an overlapped step whose every chunk was discarded, a stop seen one step late, sends no output)
    assert e["steps_total"] > 0 and e["step_outputs_total"] > 0
    assert e["overlapped_steps_total"] > 0 and e["discarded_chunks_total"] > 0  # overlap is the default
    parts = sum(e[f"step_{p}_seconds_total"] for p in ("schedule", "input", "worker", "output", "send"))
    assert min(e[f"step_{p}_seconds_total"] for p in ("input", "worker", "output", "send")) > 0
    assert e["step_seconds_total"] == pytest.approx(parts)


def test_unknown_routing_replay_key_fails_start_up(model_dir: str) -> None:
    bad = '{"enable_routing_replay": true, "oops": 1}'
    cmd = server_command(model_dir, free_port(), "--routing-replay-config", bad)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=server_env())
    assert proc.returncode != 0
    assert "unknown routing replay key(s) oops" in proc.stderr


def test_cli_serve_help_lists_engine_and_server_flags() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from fastdeploy_r3.entrypoints.cli import main; main(['serve', '--help'])"],
        capture_output=True, text=True, timeout=60, env=server_env(),
    )
    assert proc.returncode == 0, proc.stderr
    for flag in ("--routing-replay-config", "--api-key", "--num-gpu-blocks-override", "--host"):
        assert flag in proc.stdout
