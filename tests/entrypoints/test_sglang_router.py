"""The registry's sglang-router (0.3.2, as RL frameworks deploy it for data-parallel rollouts) in front
of two of our servers: a batch of /generate requests through it, every answer with exact R3, and the
control calls reaching both servers the way slime sends them.

What the router does with the calls (read from its routes): /generate goes to one worker, its body
rewritten (it adds `model`, `log_metrics`, `return_hidden_states`, ... and drops fields it does not
know, `return_routed_experts` among them: so the servers run with --enable-return-routed-experts);
POST /flush_cache is fanned out to every worker; /pause_generation and /continue_generation are not
routes of the router, and slime sends them to each engine itself, which is what this test does too.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from api_server_process import REPO_ROOT, ServerHandle, api_servers, free_port, server_env, stop_process

from fastdeploy_r3.client import decode_routed_experts

NUM_LAYERS, MOE_LAYER_IDS, TOP_K = 4, [1, 2, 3], 4  # the fake glm4_moe: layer 0 dense
R3_ON = '{"enable_routing_replay": true}'


@pytest.fixture(scope="module")
def routed(fake_model_dir, tmp_path_factory) -> Iterator[tuple[str, list[ServerHandle]]]:
    logs = str(tmp_path_factory.mktemp("logs"))
    model = fake_model_dir("glm4_moe")
    flags = ("--routing-replay-config", R3_ON, "--enable-return-routed-experts", "--max-model-len", "256")
    with api_servers(logs, (model, *flags), (model, *flags)) as (a, b):
        port = free_port()
        log = open(os.path.join(logs, "router.log"), "w")  # noqa: SIM115 - closed below, after the process
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--worker-urls", a.url, b.url, "--policy", "round_robin", "--log-level", "warn",
             # its metrics exporter binds 0.0.0.0:29000 otherwise: another router (a parallel test) collides
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=log, stderr=subprocess.STDOUT, env=server_env(), cwd=REPO_ROOT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                assert router.poll() is None, open(log.name).read()[-3000:]
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, open(log.name).read()[-3000:]
                time.sleep(0.2)
            yield url, [a, b]
        finally:
            stop_process(router, 10)
            log.close()


def _generate(url: str, prompt: list[int], max_new_tokens: int = 5) -> httpx.Response:
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def test_a_batch_through_the_router_has_exact_r3_in_every_answer(routed) -> None:
    url, servers = routed
    prompts = [[20 + i, 21, 22 + i, 23, 24 + (i % 3)] for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: _generate(url, p), prompts))
    for prompt, r in zip(prompts, answers, strict=True):
        assert r.status_code == 200, r.text
        out = r.json()
        tokens = prompt + [item[1] for item in out["meta_info"]["output_token_logprobs"]]  # slime's decoding
        rows = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
        rows = rows.reshape(len(tokens) - 1, NUM_LAYERS, TOP_K)
        # the same greedy prompt on a server directly, through the OpenAI API: the same rows, bit for bit
        direct = httpx.post(f"{servers[0].url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}).json()
        assert np.array_equal(decode_routed_experts(direct["choices"][0]["routed_experts"]), rows[:, MOE_LAYER_IDS])
        assert (rows[:, 0, :] == 255).all()  # the dense layer holds the no-route sentinel


def test_flush_cache_through_the_router_reaches_both_servers(routed) -> None:
    url, servers = routed
    prompt = list(range(30, 50))  # more than one 16-token block: a prefix hit is visible in cached_tokens
    for s in servers:
        _generate(s.url, prompt, 1)
        assert _generate(s.url, prompt, 1).json()["meta_info"]["cached_tokens"] == 16
    assert httpx.post(f"{url}/flush_cache", timeout=30).status_code == 200
    for s in servers:
        assert _generate(s.url, prompt, 1).json()["meta_info"]["cached_tokens"] == 0


def test_pause_and_continue_on_each_server_hold_and_release_requests_sent_through_the_router(routed) -> None:
    url, servers = routed
    for s in servers:  # as slime's update_weights does: every engine, directly
        assert httpx.post(f"{s.url}/pause_generation", json={}).json()["success"] is True
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: answers.append(_generate(url, [40, 41, 42]))) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    assert not answers  # held by the pause, on whichever server the router chose
    for s in servers:
        assert httpx.post(f"{s.url}/continue_generation", json={}).json()["success"] is True
    for t in threads:
        t.join(60)
    assert [r.status_code for r in answers] == [200, 200]
