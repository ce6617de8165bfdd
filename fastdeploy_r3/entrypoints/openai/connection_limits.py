"""How the HTTP server holds its connections: bounds before any request exists, and an answer for
every request when it stops.

Bounds on the connections themselves, before any request exists: uvicorn's h11 protocol with a
header deadline and a cap on open connections, so that idle or half-open sockets cannot use up the
server's file descriptors (then /health and /generate would time out for everyone, key or not).

    connection opened      past max_connections: the oldest connection still waiting for its
                           headers is closed (else the new one), its fd back before the next accept
    waiting for headers    a request's headers not complete within header_timeout_s: closed
                           (armed at connect and after each response; uvicorn's keep-alive
                           timer alone is cancelled by the first byte of a dribbled header)
    idle between requests  uvicorn's timeout_keep_alive

The default cap leaves a quarter of the fd limit (and 64 more) to the sockets accepted in a few batches
(accept_backlog), the engine's sockets, the stores and the log files.

On SIGTERM (AnsweringServer): no new connections; requests in flight get `grace_s` to finish; those
still held after it (paused in place, or just long) are failed with the reason, so each gets a JSON
503 or a final SSE error event and [DONE], never a cancelled task's plain-text 500.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from fastdeploy_r3.entrypoints.engine_client import AsyncEngineClient

logger = logging.getLogger("fastdeploy_r3.api_server")

_WARN_EVERY_S = 10.0


def _fd_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 65536 if soft == resource.RLIM_INFINITY else soft


def default_max_connections() -> int:
    """Three quarters of the process's fd limit, less 64 for everything that is not a client."""
    return max(8, _fd_limit() * 3 // 4 - 64)


def accept_backlog() -> int:
    """uvicorn's `backlog`: asyncio accepts up to this many sockets in one go, before any of them
    reaches connection_made (where the cap acts), and a busy loop can accept two or three batches
    before the first one's connections are made and the cap closes its excess, so they must fit in
    what the cap leaves: a sixteenth of the fd limit (uvicorn's 2048 would let a flood take every fd
    at once)."""
    return max(16, min(2048, _fd_limit() // 16))


def bounded_h11(header_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's `http=` protocol class with these bounds."""

    class BoundedH11Protocol(H11Protocol):
        _last_warning = float("-inf")

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_timer: asyncio.TimerHandle | None = None
            self._opened_at = 0.0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._opened_at = time.monotonic()
            if len(self.connections) > max_connections and self._make_room() is self:
                return
            self._arm_header_timer()

        def _make_room(self) -> BoundedH11Protocol | None:
            """Past the cap: abort the oldest connection still waiting for its headers (a slow or
            half-open client), so that a flood of them cannot lock a real client out; with none, this
            one. An aborted connection stays in `connections` until its connection_lost a loop
            iteration later, and one accept batch makes many connections at once: the aborted ones
            are neither counted nor chosen again (else each new one aborted the same victim and the
            fds piled up to EMFILE)."""
            live = [c for c in self.connections if c.transport is not None and not c.transport.is_closing()]
            if len(live) <= max_connections:
                return None
            waiting = [c for c in live
                       if c is not self and isinstance(c, BoundedH11Protocol) and c.waiting_for_headers()]
            victim = min(waiting, key=lambda c: c._opened_at) if waiting else self
            self._warn(f"{len(live) - 1} connections are open, the most --max-connections allows; "
                       "closing " + ("the oldest one still waiting for its headers" if waiting else "a new one"))
            victim.transport.abort()
            return victim

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()  # the next request's headers get the same deadline

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout_s, self._on_header_timeout)

        def waiting_for_headers(self) -> bool:
            """No request of this connection is being read or answered."""
            return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            if self.waiting_for_headers() and not self.transport.is_closing():
                self.transport.abort()

        @classmethod
        def _warn(cls, message: str) -> None:
            now = time.monotonic()
            if now - cls._last_warning >= _WARN_EVERY_S:
                cls._last_warning = now
                logger.warning(message)

    return BoundedH11Protocol


class AnsweringServer(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown answers the requests it would otherwise cancel.

    Its own cancellation comes `answer_window_s` after the held requests were failed: time for their
    error answers to be written."""

    answer_window_s = 5.0

    def __init__(self, config: uvicorn.Config, engine: AsyncEngineClient, grace_s: float) -> None:
        config.timeout_graceful_shutdown = int(grace_s + self.answer_window_s)
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s

    async def _wait_tasks_to_complete(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_s
        while self.engine.in_flight_request_ids() and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        held = self.engine.fail_in_flight(
            f"the server is shutting down (SIGTERM) and this request did not finish within its {self.grace_s:g} s "
            "grace window; send it again to another server or after the restart")
        if held:
            logger.warning("shutting down: answered %d request(s) still held after the grace window", held)
        await super()._wait_tasks_to_complete()
