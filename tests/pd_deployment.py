"""A prefill/decode deployment as real processes (docs/pd.md): a redis-server as the shared KV store, a
prefill server, a decode server, a colocated server with the same flags to compare with, and the
registry's sglang-router in PD mode in front of P and D. Used by tests/pd/, tests/gpu/ and
tools/bench_pd.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from api_server_process import REPO_ROOT, ServerHandle, api_servers, free_port, server_env, stop_process
from redis_server import redis_server


@dataclass
class Deployment:
    router: str
    prefill: ServerHandle
    decode: ServerHandle
    colocated: ServerHandle
    bootstrap_port: int
    store_url: str  # the redis-server P and D share


@contextlib.contextmanager
def pd_deployment(model: str, log_dir: str, common: tuple[str, ...], decode_args: tuple[str, ...] = (),
                  timeout: float = 180.0) -> Iterator[Deployment]:
    """Everything started, the router routing; `common` are every server's flags, `decode_args` D's own."""
    bootstrap_port = free_port()
    with redis_server() as url, api_servers(
        log_dir,
        (model, *common, "--kv-storage", url, "--disaggregation-mode", "prefill",
         "--disaggregation-bootstrap-port", str(bootstrap_port)),
        (model, *common, "--kv-storage", url, "--disaggregation-mode", "decode", *decode_args),
        (model, *common),
        timeout=timeout,
    ) as (p, d, colocated):
        port = free_port()
        log = open(os.path.join(log_dir, "router.log"), "w")  # noqa: SIM115 - closed below, after the process
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--pd-disaggregation", "--prefill", p.url, str(bootstrap_port), "--decode", d.url,
             "--policy", "round_robin", "--log-level", "warn"],
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
            yield Deployment(url_router, p, d, colocated, bootstrap_port, url)
        finally:
            stop_process(router, 10)
            log.close()
