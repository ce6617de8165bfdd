"""The real API server as a subprocess for end-to-end tests (free port, log file, clean stop)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO

import httpx

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER_MODULE = "fastdeploy_r3.entrypoints.openai.api_server"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listens_itself(pid: int, port: int) -> bool:
    """Whether process `pid` itself holds the socket listening on 127.0.0.1:port (Linux /proc). A free_port()
    is free only until someone binds it: another test's process can take it first, and then a plain
    connect() succeeds against the wrong listener."""
    want = f"0100007F:{port:04X}"
    inodes = set()
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/net/{name}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[1].upper() == want and fields[3] == "0A":  # local address, state LISTEN
                    inodes.add(fields[9])
    targets = {f"socket:[{i}]" for i in inodes}
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd") if targets else ():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in targets:
                    return True
    return False


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, up to `grace_s` to exit, then SIGKILL: how every server a test starts is stopped."""
    stop_processes([proc], grace_s)


def stop_processes(procs: list[subprocess.Popen], grace_s: float) -> None:
    """stop_process for several at once: every one is asked first, so that their shutdowns overlap."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_command(model_dir: str, port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", SERVER_MODULE, "--model", model_dir, "--port", str(port), "--device", "cpu", *args]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@dataclass
class ServerHandle:
    url: str
    proc: subprocess.Popen
    log_path: str

    def log_tail(self, n: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])


def _launch(model_dir: str, log_dir: str, args: tuple[str, ...],
            wrap: Callable[[list[str]], list[str]] | None) -> tuple[ServerHandle, IO[str]]:
    port = free_port()
    log_path = os.path.join(log_dir, f"server_{port}.log")
    log = open(log_path, "w")  # noqa: SIM115 - closed by the caller, after the process
    cmd = server_command(model_dir, port, *args)
    proc = subprocess.Popen(wrap(cmd) if wrap else cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=server_env(), cwd=REPO_ROOT)
    return ServerHandle(f"http://127.0.0.1:{port}", proc, log_path), log


def _wait_healthy(handle: ServerHandle, args: tuple[str, ...], deadline: float, timeout: float) -> None:
    # with --api-key, /health needs the key too
    headers = {"Authorization": f"Bearer {args[args.index('--api-key') + 1]}"} if "--api-key" in args else {}
    while True:
        if handle.proc.poll() is not None:
            raise RuntimeError(f"server exited with {handle.proc.returncode} during start-up:\n{handle.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{handle.url}/health", headers=headers, timeout=2.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not healthy within {timeout} s:\n{handle.log_tail()}")
        time.sleep(0.2)


@contextlib.contextmanager
def api_servers(
    log_dir: str,
    *servers: tuple[str, ...],
    timeout: float = 180.0,
) -> Iterator[list[ServerHandle]]:
    """Several servers, each `(model_dir, *args)`, started at once and waited for together: one start is
    a chain of process starts (API server, engine, worker) that keeps one core busy, so on two cores a
    second chain costs little more wall time than the first."""
    launched: list[tuple[ServerHandle, IO[str]]] = []
    try:
        for model_dir, *args in servers:
            launched.append(_launch(model_dir, log_dir, tuple(args), None))
        deadline = time.monotonic() + timeout
        for (handle, _), (_, *args) in zip(launched, servers):
            _wait_healthy(handle, tuple(args), deadline, timeout)
        yield [handle for handle, _ in launched]
    finally:
        stop_processes([handle.proc for handle, _ in launched], 60)
        for _, log in launched:
            log.close()


@contextlib.contextmanager
def api_server(
    model_dir: str,
    log_dir: str,
    *args: str,
    timeout: float = 180.0,
    wrap: Callable[[list[str]], list[str]] | None = None,
) -> Iterator[ServerHandle]:
    """Start `python -m fastdeploy_r3.entrypoints.openai.api_server` and wait until /health is 200.

    `wrap` turns the command into the one to run (e.g. in a private mount namespace; it must exec so
    that the server keeps the pid of the process started here)."""
    handle, log = _launch(model_dir, log_dir, args, wrap)
    try:
        _wait_healthy(handle, args, time.monotonic() + timeout, timeout)
        yield handle
    finally:
        stop_process(handle.proc, 60)
        log.close()


def stream_generate(server: ServerHandle, body: dict) -> tuple[threading.Thread, list[dict]]:
    """POST a streamed /generate from a thread; return once its first chunk is in (the list keeps filling)."""
    chunks: list[dict] = []

    def run() -> None:
        with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[len("data: "):]))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    while not chunks:
        assert t.is_alive()
        threading.Event().wait(0.01)
    return t, chunks
