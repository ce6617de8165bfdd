"""slime's and miles' own call sequences, recorded from their code into tests/fixtures/rl_frameworks/
(framework repo and commit named in each file), replayed through the real server: what each framework
parses from the answers must come out as it expects. Rollouts: tokens from output_token_logprobs, float
logprobs, routed_experts decoding to (len(tokens) - 1, num_hidden_layers, top_k) with the MoE rows of
/v1/completions for the same greedy prompt, finish reasons; start-up: the server-info fields their
external-engine checks compare; abort: /v1/loads idle as slime's idle check reads it."""

from __future__ import annotations

import base64
import glob
import json
import math
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from api_server_process import ServerHandle, api_server

from fastdeploy_r3.client import decode_routed_experts

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "rl_frameworks")
SEQUENCES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(FIXTURES, "*.json"))
                   if "steps" in json.load(open(p)))
NUM_LAYERS, MOE_LAYER_IDS, TOP_K = 4, [1, 2, 3], 4  # the fake glm4_moe: layer 0 dense


@pytest.fixture(scope="module")
def server(fake_model_dir, tmp_path_factory) -> Iterator[ServerHandle]:
    logs = str(tmp_path_factory.mktemp("logs"))
    with api_server(fake_model_dir("glm4_moe"), logs, "--routing-replay-config", '{"enable_routing_replay": true}',
                    "--max-model-len", "256") as handle:
        yield handle


def _requests_in_load(load: Any) -> int:
    """What slime's idle check counts in a /v1/loads answer: per entry its total, else running + waiting."""
    if isinstance(load, list):
        return sum(_requests_in_load(x) for x in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return _requests_in_load(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return load[key]
    return sum(v for v in (load.get("num_running_reqs"), load.get("num_waiting_reqs")) if isinstance(v, int))


def _check_rollout(server: ServerHandle, body: dict, r: httpx.Response) -> None:
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    prompt = body["input_ids"]
    tokens = prompt + [item[1] for item in meta["output_token_logprobs"]]  # as the frameworks rebuild them
    logprobs = [item[0] for item in meta["output_token_logprobs"]]
    assert all(isinstance(x, float) and math.isfinite(x) for x in logprobs)
    assert tokens[len(prompt):] == out["output_ids"] and meta["completion_tokens"] == len(out["output_ids"])
    assert meta["finish_reason"]["type"] in ("length", "stop")
    rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    rows = rows.reshape(len(tokens) - 1, NUM_LAYERS, TOP_K)
    direct = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": meta["completion_tokens"], "temperature": 0, "ignore_eos": True}).json()
    assert np.array_equal(decode_routed_experts(direct["choices"][0]["routed_experts"]), rows[:, MOE_LAYER_IDS])


def _check(server: ServerHandle, step: dict, body: Any, r: httpx.Response) -> None:
    expect = step["expect"]
    if expect == "rollout":
        _check_rollout(server, body, r)
        return
    assert r.status_code == 200, f"{step['call']} {step['path']}: {r.status_code} {r.text}"
    answer = r.json() if r.headers.get("content-type", "").startswith("application/json") else None
    if isinstance(expect, dict):
        assert {k: answer[k] for k in expect} == expect
    elif expect == "server_info":
        port = int(server.url.rsplit(":", 1)[1])
        assert {k: answer[k] for k in step["compare"]} == step["compare"]
        assert all(k in answer for k in step["read"])
        assert (answer["host"], answer["port"], answer["tp_size"]) == ("127.0.0.1", port, 1)
    elif expect == "idle":
        assert _requests_in_load(answer) == 0
    elif isinstance(answer, dict) and "success" in answer:
        assert answer["success"] is True, answer


@pytest.mark.parametrize("sequence", SEQUENCES)
def test_replay(server: ServerHandle, fake_model_dir, sequence: str) -> None:
    doc = json.load(open(os.path.join(FIXTURES, sequence)))
    assert doc["repo"] and len(doc["commit"]) == 40  # where the calls were read
    model_path = fake_model_dir("glm4_moe")
    background: list[tuple[threading.Thread, dict]] = []
    for step in doc["steps"]:
        body = json.loads(json.dumps(step.get("body")).replace("{model_path}", model_path))
        url = f"{server.url}{step['path']}"
        if step.get("background"):
            answers: dict = {}
            t = threading.Thread(target=lambda u=url, b=body, a=answers: a.update(r=httpx.post(u, json=b, timeout=120)))
            t.start()
            background.append((t, answers))
            deadline = time.monotonic() + 30
            while httpx.get(f"{server.url}/get_server_info").json()["num_requests"] < 1:
                assert t.is_alive(), f"the request in flight was answered at once: {answers['r'].text}"
                assert time.monotonic() < deadline
                time.sleep(0.02)
            continue
        r = httpx.request(step["call"], url, json=body, timeout=120) if body is not None else \
            httpx.request(step["call"], url, timeout=120)
        _check(server, step, body, r)
    for t, answers in background:
        t.join(60)
        assert answers["r"].status_code == 200
        assert answers["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
