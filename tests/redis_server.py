"""A real, throwaway `redis-server` for tests (the Debian package, not a fake)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

from api_server_process import free_port, listens_itself, stop_process

REDIS_SERVER = "/usr/bin/redis-server"


class RedisServerMissing(RuntimeError):
    pass


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {proc.returncode} before accepting connections")
        if not listens_itself(proc.pid, port):  # not yet, or another process holds the port: no PING there
            time.sleep(0.02)
            continue
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"redis-server on port {port} did not answer PING within {timeout} s")


def redis_pid(url: str) -> int:
    """The pid of the redis-server behind `url` (it retitles itself "redis-server 127.0.0.1:PORT")."""
    port = url.rsplit(":", 1)[1].split("/")[0]
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{name}/cmdline", "rb") as f:
                words = f.read().replace(b"\0", b" ").split()
                if words and b"redis-server" in words[0] and any(w.endswith(f":{port}".encode()) for w in words):
                    return int(name)
    raise RuntimeError(f"no redis-server on port {port}")


@contextlib.contextmanager
def redis_server(timeout: float = 10.0) -> Iterator[str]:
    """Start redis-server on a free 127.0.0.1 port without persistence; yield `redis://127.0.0.1:PORT/0`."""
    exe = REDIS_SERVER if os.path.exists(REDIS_SERVER) else shutil.which("redis-server")
    if exe is None:
        raise RedisServerMissing("redis-server is not installed; run `apt-get install -y redis-server`")
    tmp = tempfile.mkdtemp(prefix="fdr3_redis_")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_ready(port, proc, timeout)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_process(proc, 5)
        shutil.rmtree(tmp, ignore_errors=True)
