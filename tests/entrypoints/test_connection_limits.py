"""A server under `ulimit -n 512` against more half-open connections than it has fds: it stays
responsive and closes them (before: `Too many open files`, /health and /generate timed out); then
SIGTERM while requests are held paused in place: each gets a clear answer (a JSON 503, or a final
SSE error event and [DONE]) instead of a plain-text 500 or a stream cut off."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from api_server_process import ServerHandle, api_server

FD_LIMIT = 512
HALF_OPEN = 700  # more than the server's whole fd limit
HEADER_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def server(fake_model_dir, tmp_path_factory) -> Iterator[ServerHandle]:
    def low_fd_limit(cmd: list[str]) -> list[str]:
        return ["bash", "-c", f'ulimit -n {FD_LIMIT} && exec "$@"', "bash", *cmd]

    logs = str(tmp_path_factory.mktemp("logs"))
    with api_server(fake_model_dir("glm4_moe"), logs, "--header-timeout-s", str(HEADER_TIMEOUT_S),
                    "--shutdown-grace-s", "1", wrap=low_fd_limit) as handle:
        yield handle


def _half_open(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # the header never ends
    return s


def _closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_half_open_connections_past_the_fd_limit_neither_starve_nor_stay(server: ServerHandle) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    socks = [_half_open(port) for _ in range(HALF_OPEN)]
    try:
        t0 = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200  # a new client still gets in
        r = httpx.post(f"{server.url}/generate", json={"input_ids": [20, 21, 22],
                                                       "sampling_params": {"max_new_tokens": 2}}, timeout=30)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
        assert time.monotonic() - t0 < 10
        time.sleep(HEADER_TIMEOUT_S + 1)
        for s in socks:
            s.settimeout(2)
        assert all(_closed_by_server(s) for s in socks)  # none is left holding an fd
    finally:
        for s in socks:
            s.close()
    with open(server.log_path) as f:
        log = f.read()
    assert "Too many open files" not in log, log[-4000:]


def test_sigterm_answers_every_held_request_then_exits(server: ServerHandle) -> None:
    """One stream paused mid-generation, one request that arrived while paused: both held at SIGTERM."""
    body = {"input_ids": [20, 21, 22], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    answers: dict[str, object] = {}
    streamed = threading.Event()

    def stream() -> None:
        lines = answers["stream"] = []
        with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    streamed.set()

    def plain() -> None:
        answers["plain"] = httpx.post(f"{server.url}/generate", json=body, timeout=60)

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    threads[0].start()
    assert streamed.wait(30)
    assert httpx.post(f"{server.url}/pause_generation", json={"mode": "in_place"}).json()["success"] is True
    threads[1].start()
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/get_server_info").json()["num_requests"] < 2:  # both held by the pause
        assert time.monotonic() < deadline
        time.sleep(0.05)
    server.proc.terminate()
    for t in threads:
        t.join(30)
    plain_answer = answers["plain"]
    assert isinstance(plain_answer, httpx.Response) and plain_answer.status_code == 503
    assert "shutting down (SIGTERM)" in plain_answer.json()["error"]["message"]
    lines = answers["stream"]
    assert isinstance(lines, list) and lines[-1] == "data: [DONE]"
    assert "shutting down (SIGTERM)" in json.loads(lines[-2][len("data: "):])["error"]["message"]
    assert len(lines) > 2  # tokens were streamed before the pause
    assert server.proc.wait(30) is not None


def test_the_servers_connections_have_nagle_off() -> None:
    """The listening socket is bound by the server itself; asyncio switches Nagle off only on sockets whose
    proto is TCP, and with Nagle on each response waited ~40 ms for the client's delayed ACK."""
    import asyncio
    import socket

    from fastdeploy_r3.entrypoints.openai.api_server import _bind

    async def story() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        listener = _bind("127.0.0.1", 0)
        server = await asyncio.start_server(accepted, sock=listener)
        _, writer = await asyncio.open_connection(*listener.getsockname())
        value = await asyncio.wait_for(seen, 10)
        writer.close()
        server.close()
        return value

    assert asyncio.run(story()) != 0
