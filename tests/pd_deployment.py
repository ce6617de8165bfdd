"""A prefill/decode deployment as real processes (docs/pd.md): a redis-server as the shared KV store, a
prefill server, a decode server, a colocated server with the same flags to compare with, and the
registry's sglang-router in PD mode in front of P and D. Used by tests/pd/, tests/gpu/ and
tools/bench_pd.py. Below it, what the PD fault tests do to a server tree and check afterwards."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import faults
import httpx
from api_server_process import REPO_ROOT, ServerHandle, api_servers, free_port, server_env, stop_process
from redis_server import redis_server

from fastdeploy_r3.cache_manager.shm import remove_stale_segments
from fastdeploy_r3.lifecycle import remove_stale_ipc_dirs


@dataclass
class Deployment:
    router: str
    prefill: ServerHandle
    decode: ServerHandle
    colocated: ServerHandle
    bootstrap_port: int
    store_url: str  # the redis-server P and D share ("" with the mooncake backend)
    log_dir: str = ""  # the servers' logs; with the mooncake backend also their file stores, {p,d}_store


@contextlib.contextmanager
def pd_deployment(model: str, log_dir: str, common: tuple[str, ...], decode_args: tuple[str, ...] = (),
                  timeout: float = 180.0, backend: str = "store") -> Iterator[Deployment]:
    """Everything started, the router routing; `common` are every server's flags, `decode_args` D's own.
    backend "store": P and D share a redis-server; "mooncake": each has its own file store (under
    log_dir), and blocks move from P to D only over Mooncake Transfer Engine."""
    bootstrap_port = free_port()
    with contextlib.ExitStack() as stack:
        if backend == "store":
            url = stack.enter_context(redis_server())
            p_store, d_store, extra = url, url, ()
        else:
            url = ""
            p_store, d_store = (f"file://{os.path.join(log_dir, side + '_store')}" for side in ("p", "d"))
            extra = ("--disaggregation-transfer-backend", backend, "--disaggregation-te-arena-mb", "4")
        p, d, colocated = stack.enter_context(api_servers(
            log_dir,
            (model, *common, "--kv-storage", p_store, "--disaggregation-mode", "prefill",
             "--disaggregation-bootstrap-port", str(bootstrap_port), *extra),
            (model, *common, "--kv-storage", d_store, "--disaggregation-mode", "decode", *extra, *decode_args),
            (model, *common),
            timeout=timeout,
        ))
        port = free_port()
        log = open(os.path.join(log_dir, "router.log"), "w")  # noqa: SIM115 - closed below, after the process
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--pd-disaggregation", "--prefill", p.url, str(bootstrap_port), "--decode", d.url,
             "--policy", "round_robin", "--log-level", "warn",
             # its metrics exporter binds 0.0.0.0:29000 otherwise: another router (a parallel test) collides
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=log, stderr=subprocess.STDOUT, env=server_env(), cwd=REPO_ROOT)
        url_router = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:  # /health answers before the workers are registered: wait for a routed request
                if router.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sglang-router did not route a request:\n{open(log.name).read()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    r = httpx.post(f"{url_router}/generate", timeout=30, json={
                        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
                    if r.status_code == 200:
                        break
                time.sleep(0.3)
            yield Deployment(url_router, p, d, colocated, bootstrap_port, url, log_dir)
        finally:
            stop_process(router, 10)
            log.close()


def check_integrity(server: ServerHandle) -> dict:
    r = httpx.get(f"{server.url}/check_integrity", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def assert_idle_and_clean(server: ServerHandle) -> None:
    """The server's KV books agree and, with nothing in flight, no block is reserved."""
    report = check_integrity(server)
    assert report["success"] and report["message"] == "ok", report
    assert (report["num_requests"], report["num_referenced_blocks"]) == (0, 0), report
    load = httpx.get(f"{server.url}/v1/loads", timeout=30).json()["loads"][0]
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 0)


def server_tree(server: ServerHandle) -> tuple[dict[str, int], list[int]]:
    """(roles, pids) of a server's process tree, found before the fault so that the kill is immediate."""
    roles = faults.wait_for_roles(server.proc.pid, ("engine", "worker", "ctm"))
    return roles, [server.proc.pid, *faults.descendants(server.proc.pid)]


def kill_tree(server: ServerHandle, pids: list[int]) -> None:
    """SIGKILL every process of a server tree at once: none gets to clean up after itself."""
    for pid in pids:
        faults.kill(pid)
    server.proc.wait(timeout=30)


def assert_swept(roles: dict[str, int], pids: list[int]) -> None:
    """Nothing of a killed tree is left once the next start's sweep has run."""
    deadline = time.monotonic() + 30
    # gone from /proc, not just dead: a zombie not yet reaped by init still counts as a live pid to the
    # sweep (its segments are kept as an owner's)
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    remove_stale_segments()
    remove_stale_ipc_dirs()
    left = faults.leftovers(roles, pids)
    assert left.count == 0, str(left)


def most_unread_bytes(port: int) -> int:
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


def generate_greedy(url: str, prompt: list[int], max_new_tokens: int, stream: bool = False,
                    timeout: float = 120) -> dict:
    """POST /generate of `prompt` (greedy, ignore_eos) to `url`; the answer, or a stream's last chunk."""
    body = {"input_ids": prompt, "stream": stream,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    if not stream:
        r = httpx.post(f"{url}/generate", json=body, timeout=timeout)
        assert r.status_code == 200, r.text
        return r.json()
    last = None
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=timeout) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[len("data: "):])
    assert last is not None
    return last
