"""Prefill/decode disaggregation with R3 in debug mode (every row holds its position), and D's death,
as real processes: a redis-server as the shared KV store, a prefill server P and a decode server D,
started once for the file. Requests are posted to P and D at once, with the same bootstrap fields, as
sglang-router posts them (tests/pd/test_pd_router.py drives the router itself, and kills P last).

What must hold (docs/pd.md):
- through PD, a response's rows are exactly positions 0 .. P + N - 2, whether P computed the prompt or
  served it from its own prefix cache, with or without a partial last block;
- D killed with requests in flight: its clients' connections end (nothing hangs), P is untouched (its
  books clean, nothing reserved) and hands the next request over at once;
- a dead server tree leaves no process; its /dev/shm segments and IPC directory are swept by the next
  server start on the machine (shm.remove_stale_segments, lifecycle.remove_stale_ipc_dirs: what
  EngineService and the API server run at start, called here directly).
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
from api_server_process import ServerHandle, api_servers, free_port
from pd_deployment import assert_idle_and_clean, assert_swept, kill_tree, server_tree
from redis_server import redis_server

NUM_LAYERS, TOP_K = 4, 4  # the fake glm4_moe: layer 0 is dense, its rows hold the sentinel
DENSE_SENTINEL = 255  # the fake model's routing dtype is uint8
BLOCK = 4
REQUEST_TIMEOUT_S = 30  # every request's deadline: a fault case that hangs fails the test within it
R3_DEBUG = json.dumps({"enable_routing_replay": True, "debug_mode": True})
PREFIX = [30 + i for i in range(8)]  # two full blocks shared by the first prompts


@dataclass
class DebugDeployment:
    prefill: ServerHandle
    decode: ServerHandle
    bootstrap_port: int
    store_url: str


@pytest.fixture(scope="module")
def pd(fake_model_dir, tmp_path_factory) -> Iterator[DebugDeployment]:
    common = ("--routing-replay-config", R3_DEBUG, "--enable-return-routed-experts", "--max-model-len", "48",
              "--block-size", str(BLOCK), "--max-num-batched-tokens", "8", "--request-timeout-s",
              str(REQUEST_TIMEOUT_S))
    model = fake_model_dir("glm4_moe")
    bootstrap_port = free_port()
    with redis_server() as url, api_servers(
        str(tmp_path_factory.mktemp("pd_fault_logs")),
        (model, *common, "--kv-storage", url, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
         str(bootstrap_port)),
        (model, *common, "--kv-storage", url, "--disaggregation-mode", "decode"),
    ) as (p, d):
        yield DebugDeployment(p, d, bootstrap_port, url)


def _body(prompt: list[int], room: int, port: int, max_new_tokens: int, stream: bool = False) -> dict:
    return {"input_ids": prompt, "stream": stream, "bootstrap_host": "127.0.0.1", "bootstrap_port": port,
            "bootstrap_room": room, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                        "ignore_eos": True}}


def _through_pd(pd: DebugDeployment, prompt: list[int], room: int, max_new_tokens: int) -> dict:
    """D's answer to one request posted to P and D at once, as the router posts it."""
    body = _body(prompt, room, pd.bootstrap_port, max_new_tokens)
    with ThreadPoolExecutor(2) as pool:
        d = pool.submit(httpx.post, f"{pd.decode.url}/generate", json=body, timeout=60)
        p = pool.submit(httpx.post, f"{pd.prefill.url}/generate", json=body, timeout=60)
        d_r, p_r = d.result(), p.result()
    assert p_r.status_code == 200, p_r.text
    assert d_r.status_code == 200, d_r.text
    return d_r.json()


def _assert_rows_are_positions(meta: dict, num_rows: int) -> None:
    rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    assert rows.size == num_rows * NUM_LAYERS * TOP_K, (rows.size, num_rows)
    want = np.broadcast_to(np.arange(num_rows, dtype=np.int32)[:, None, None], (num_rows, NUM_LAYERS, TOP_K)).copy()
    want[:, 0] = DENSE_SENTINEL
    assert np.array_equal(rows.reshape(num_rows, NUM_LAYERS, TOP_K), want)


def test_rows_through_pd_are_exactly_the_positions_in_debug_mode(pd: DebugDeployment) -> None:
    # P computes the first prompt; the second shares its two full blocks (P serves them from its own
    # cache, D loads them as stored blocks); partial and full last blocks; a first token that ends it
    cases = [(PREFIX + [60, 61, 62], 5), (PREFIX + [70, 71, 72, 73], 4), (PREFIX + [80], 1)]
    for room, (prompt, n) in enumerate(cases, start=100):
        out = _through_pd(pd, prompt, room, n)
        assert len(out["output_ids"]) == n
        _assert_rows_are_positions(out["meta_info"], len(prompt) + n - 1)
        # the partial last block too, unless P's token ended the request (D then computes the prompt's last token)
        assert out["meta_info"]["cached_tokens"] == (len(prompt) if n > 1 else len(prompt) // BLOCK * BLOCK)
    for server in (pd.prefill, pd.decode):
        assert_idle_and_clean(server)


def test_d_killed_with_requests_in_flight_leaves_p_clean_and_handing_over_the_next(pd: DebugDeployment) -> None:
    prompts = [[120 + 10 * i + j for j in range(6)] for i in range(3)]
    roles, pids = server_tree(pd.decode)
    first_chunk = threading.Event()
    ended: list[str] = []

    def stream_on_d(prompt: list[int], room: int) -> None:
        try:
            body = _body(prompt, room, pd.bootstrap_port, 40, stream=True)
            with httpx.stream("POST", f"{pd.decode.url}/generate", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        first_chunk.set()
            ended.append("finished")  # too fast for the kill: the test says so below
        except httpx.HTTPError as e:
            ended.append(type(e).__name__)

    streams = [threading.Thread(target=stream_on_d, args=(p, 200 + i), daemon=True) for i, p in enumerate(prompts)]
    for t in streams:
        t.start()
    for i, prompt in enumerate(prompts):
        r = httpx.post(f"{pd.prefill.url}/generate", json=_body(prompt, 200 + i, pd.bootstrap_port, 40), timeout=60)
        assert r.status_code == 200, r.text
    assert first_chunk.wait(REQUEST_TIMEOUT_S)
    kill_tree(pd.decode, pids)
    started = time.monotonic()
    for t in streams:
        t.join(REQUEST_TIMEOUT_S)
    assert not any(t.is_alive() for t in streams), "a client of the killed decode server still waits"
    assert time.monotonic() - started < REQUEST_TIMEOUT_S
    assert len(ended) == 3 and "finished" not in ended, ended  # every stream was cut, none ran to its end

    assert_idle_and_clean(pd.prefill)  # P handed over and kept nothing for the dead D
    # P hands the next request over at once: its answer has the prompt's rows (positions), and the
    # room's handoff is published, without error, for whichever D asks
    prompt = prompts[0]
    r = httpx.post(f"{pd.prefill.url}/generate", json=_body(prompt, 299, pd.bootstrap_port, 3), timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 1  # P samples the first token only
    _assert_rows_are_positions(r.json()["meta_info"], len(prompt))
    handoff = httpx.get(f"http://127.0.0.1:{pd.bootstrap_port}/pd/rooms/299", timeout=30).json()
    assert (handoff["error"], handoff["token_id"]) == (None, r.json()["output_ids"][0])
    assert_swept(roles, pids)
