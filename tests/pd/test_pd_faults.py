"""Prefill/decode disaggregation with R3 in debug mode (every row holds its position), and its faults,
as real processes: a redis-server as the shared KV store, one prefill server P and two decode servers
Da and Db, started once for the file. Requests are posted to P and D at once, with the same bootstrap
fields, as sglang-router posts them (tests/pd/test_pd_router.py drives the router itself).

What must hold (docs/pd.md):
- through PD, a response's rows are exactly positions 0 .. P + N - 2, whether P computed the prompt or
  served it from its own prefix cache, with or without a partial last block;
- D killed with requests in flight: its clients' connections end (nothing hangs), P is untouched (its
  books clean, nothing reserved) and hands over to another D at once;
- P killed while its blocks are being written (the store stopped, the first blob in its receive queue),
  D waiting for the handoff: D answers 502 within seconds, nothing reserved or running on D, D serves on;
- a dead server tree leaves no process; its /dev/shm segments and IPC directory are swept by the next
  server start on the machine (shm.remove_stale_segments, lifecycle.remove_stale_ipc_dirs: what
  EngineService and the API server run at start, called here directly).

The cases run in file order: the debug-position check first, then D's death, then P's.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import faults
import httpx
import numpy as np
import pytest
from api_server_process import ServerHandle, api_servers, free_port
from redis_server import redis_pid, redis_server

from fastdeploy_r3.cache_manager.shm import remove_stale_segments
from fastdeploy_r3.lifecycle import remove_stale_ipc_dirs

NUM_LAYERS, TOP_K = 4, 4  # the fake glm4_moe: layer 0 is dense, its rows hold the sentinel
DENSE_SENTINEL = 255  # the fake model's routing dtype is uint8
BLOCK = 4
REQUEST_TIMEOUT_S = 30  # every request's deadline: a fault case that hangs fails the test within it
R3_DEBUG = json.dumps({"enable_routing_replay": True, "debug_mode": True})
PREFIX = [30 + i for i in range(8)]  # two full blocks shared by the first prompts


@dataclass
class DebugDeployment:
    prefill: ServerHandle
    decode_a: ServerHandle
    decode_b: ServerHandle
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
        (model, *common, "--kv-storage", url, "--disaggregation-mode", "decode"),
    ) as (p, da, db):
        yield DebugDeployment(p, da, db, bootstrap_port, url)


def _body(prompt: list[int], room: int, port: int, max_new_tokens: int, stream: bool = False) -> dict:
    return {"input_ids": prompt, "stream": stream, "bootstrap_host": "127.0.0.1", "bootstrap_port": port,
            "bootstrap_room": room, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                        "ignore_eos": True}}


def _through_pd(pd: DebugDeployment, decode: ServerHandle, prompt: list[int], room: int,
                max_new_tokens: int) -> dict:
    """D's answer to one request posted to P and D at once, as the router posts it."""
    body = _body(prompt, room, pd.bootstrap_port, max_new_tokens)
    with ThreadPoolExecutor(2) as pool:
        d = pool.submit(httpx.post, f"{decode.url}/generate", json=body, timeout=60)
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


def _integrity(server: ServerHandle) -> dict:
    r = httpx.get(f"{server.url}/check_integrity", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _assert_idle_and_clean(server: ServerHandle) -> None:
    """The server's KV books agree and, with nothing in flight, no block is reserved."""
    report = _integrity(server)
    assert report["success"] and report["message"] == "ok", report
    assert (report["num_requests"], report["num_referenced_blocks"]) == (0, 0), report
    load = httpx.get(f"{server.url}/v1/loads", timeout=30).json()["loads"][0]
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 0)


def _tree(server: ServerHandle) -> tuple[dict[str, int], list[int]]:
    """(roles, pids) of a server's process tree, found before the fault so that the kill is immediate."""
    roles = faults.wait_for_roles(server.proc.pid, ("engine", "worker", "ctm"))
    return roles, [server.proc.pid, *faults.descendants(server.proc.pid)]


def _kill_tree(server: ServerHandle, pids: list[int]) -> None:
    """SIGKILL every process of a server tree at once: none gets to clean up after itself."""
    for pid in pids:
        faults.kill(pid)
    server.proc.wait(timeout=30)


def _assert_swept(roles: dict[str, int], pids: list[int]) -> None:
    """Nothing of a killed tree is left once the next start's sweep has run."""
    deadline = time.monotonic() + 30
    while any(faults.alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # the init process reaps the orphans
    remove_stale_segments()
    remove_stale_ipc_dirs()
    left = faults.leftovers(roles, pids)
    assert left.count == 0, str(left)


def test_rows_through_pd_are_exactly_the_positions_in_debug_mode(pd: DebugDeployment) -> None:
    # P computes the first prompt; the second shares its two full blocks (P serves them from its own
    # cache, D loads them as stored blocks); partial and full last blocks; a first token that ends it
    cases = [(PREFIX + [60, 61, 62], 5), (PREFIX + [70, 71, 72, 73], 4), (PREFIX + [80], 1)]
    for room, (prompt, n) in enumerate(cases, start=100):
        out = _through_pd(pd, pd.decode_a, prompt, room, n)
        assert len(out["output_ids"]) == n
        _assert_rows_are_positions(out["meta_info"], len(prompt) + n - 1)
        assert out["meta_info"]["cached_tokens"] == len(prompt) // BLOCK * BLOCK
    for server in (pd.prefill, pd.decode_a):
        _assert_idle_and_clean(server)


def test_d_killed_with_requests_in_flight_leaves_p_clean_and_handing_over(pd: DebugDeployment) -> None:
    prompts = [[120 + 10 * i + j for j in range(6)] for i in range(3)]
    roles, pids = _tree(pd.decode_a)
    first_chunk = threading.Event()
    ended: list[str] = []

    def stream_on_d(prompt: list[int], room: int) -> None:
        try:
            body = _body(prompt, room, pd.bootstrap_port, 40, stream=True)
            with httpx.stream("POST", f"{pd.decode_a.url}/generate", json=body, timeout=60) as r:
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
    _kill_tree(pd.decode_a, pids)
    started = time.monotonic()
    for t in streams:
        t.join(REQUEST_TIMEOUT_S)
    assert not any(t.is_alive() for t in streams), "a client of the killed decode server still waits"
    assert time.monotonic() - started < REQUEST_TIMEOUT_S
    assert len(ended) == 3 and "finished" not in ended, ended  # every stream was cut, none ran to its end

    _assert_idle_and_clean(pd.prefill)  # P handed over and kept nothing for the dead D
    out = _through_pd(pd, pd.decode_b, prompts[0], 299, 3)  # P's cache still serves the prompt
    _assert_rows_are_positions(out["meta_info"], len(prompts[0]) + 3 - 1)
    _assert_swept(roles, pids)


def test_p_killed_while_its_blocks_are_written_fails_d_with_502_and_leaves_d_clean(pd: DebugDeployment) -> None:
    prompt = [150 + i for i in range(13)]  # 3 full blocks no other case stored
    body = _body(prompt, 300, pd.bootstrap_port, 4)
    roles, pids = _tree(pd.prefill)
    redis = redis_pid(pd.store_url)
    store_port = int(pd.store_url.rsplit(":", 1)[1].split("/")[0])
    # P's write-through cannot finish, so P never publishes room 300; P's own lookup of the prompt's
    # blocks misses its deadline (the default 2 s) first, then P computes them and the CTM writes
    os.kill(redis, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as pool:
            d = pool.submit(httpx.post, f"{pd.decode_b.url}/generate", json=body, timeout=60)
            pool.submit(_post_quietly, f"{pd.prefill.url}/generate", body)
            # the first blob of the prompt (KV and rows, > 1 KiB) sits unread in the stopped store's socket
            deadline = time.monotonic() + REQUEST_TIMEOUT_S
            while _most_unread_bytes(store_port) < 1024:
                assert time.monotonic() < deadline, "P never started writing its blocks"
                time.sleep(0.02)
            _kill_tree(pd.prefill, pids)
            killed = time.monotonic()
            r = d.result(timeout=REQUEST_TIMEOUT_S)
    finally:
        os.kill(redis, signal.SIGCONT)
    assert time.monotonic() - killed < 15  # D gives P 2 s to come back, not the request's deadline
    assert r.status_code == 502, r.text
    assert "unreachable" in r.json()["error"]["message"]

    _assert_idle_and_clean(pd.decode_b)  # the request never entered D's engine
    plain = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
    served = httpx.post(f"{pd.decode_b.url}/generate", json=plain, timeout=60)
    assert served.status_code == 200, served.text
    _assert_rows_are_positions(served.json()["meta_info"], len(prompt) + 3 - 1)  # whatever P left is exact
    _assert_swept(roles, pids)


def _post_quietly(url: str, body: dict) -> None:
    """P's side of the request: its server is killed under it, so no answer is expected."""
    try:
        httpx.post(url, json=body, timeout=60)
    except httpx.HTTPError:
        pass


def _most_unread_bytes(port: int) -> int:
    """The most bytes one client sent to 127.0.0.1:port that its (stopped) server has not read:
    /proc/net/tcp's rx_queue of the server's side of each connection (a lookup or a ping is far less
    than a block's blob)."""
    most = 0
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].split(":")[1], 16)
            if local_port == port and fields[3] == "01":  # ESTABLISHED
                most = max(most, int(fields[4].split(":")[1], 16))
    return most
