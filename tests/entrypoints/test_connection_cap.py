"""The connection cap against one accept batch: asyncio accepts a whole backlog of sockets before any
of them reaches connection_made, so the cap acts on many new connections within one loop iteration.
Before: each of them aborted the same oldest connection (still in `connections` until its
connection_lost, an iteration later), the others stayed open, and a flood took the server's fds."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from uvicorn.server import ServerState

from fastdeploy_r3.entrypoints.openai.connection_limits import bounded_h11

CAP = 4
FLOOD = 12


async def _app(scope, receive, send) -> None:  # never reached: no request completes its headers
    raise AssertionError("no request was expected")


async def _flood_in_one_batch() -> tuple[int, int]:
    """FLOOD half-open clients queue in the kernel backlog while the loop is busy, so that one accept
    batch takes them all; returns (connections left open, clients the server closed)."""
    config = uvicorn.Config(_app, log_level="warning")
    config.load()
    state = ServerState()
    loop = asyncio.get_running_loop()
    protocol = bounded_h11(header_timeout_s=60.0, max_connections=CAP)
    server = await loop.create_server(lambda: protocol(config, state, {}, loop), "127.0.0.1", 0, backlog=64)
    port = server.sockets[0].getsockname()[1]
    clients = []
    for _ in range(FLOOD):  # blocking connects: the loop does not run, the kernel queues them
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        s.setblocking(False)
        clients.append(s)
    await asyncio.sleep(0.3)
    left = len(state.connections)
    closed = 0
    for s in clients:
        try:
            closed += s.recv(1) == b""
        except ConnectionResetError:
            closed += 1
        except BlockingIOError:
            pass
        s.close()
    server.close()
    return left, closed


def test_one_accept_batch_past_the_cap_leaves_exactly_the_cap_open() -> None:
    left, closed = asyncio.run(_flood_in_one_batch())
    assert (left, closed) == (CAP, FLOOD - CAP)
