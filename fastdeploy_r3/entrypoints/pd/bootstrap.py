"""P's bootstrap server and D's client of it.

    P: POST /generate {..., bootstrap_room: R}   computes the prompt, then Rooms.publish(R, handoff)
    D: GET  http://P_host:bootstrap_port/pd/rooms/R?wait_s=W
         200 {handoff}       P is done with R (or failed it: `error` says why)
         404 {"pending": R}  nothing yet within W seconds: ask again (a long poll, so D hears at once)
         503 {"error"}       P is shutting down (its waiting polls are answered at once)

The router sends a request to P and D at the same moment, so D usually asks before P has finished;
the long poll answers the moment the room is published. A published room is kept for ROOM_TTL_S (D
may ask again after a lost answer), and at most MAX_ROOMS rooms are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import OrderedDict

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from fastdeploy_r3.entrypoints.pd.handoff import MAX_ROOM, Bootstrap, Handoff, HandoffError
from fastdeploy_r3.entrypoints.pd.te_in_place import add_in_place_route
from fastdeploy_r3.entrypoints.pd.te_transfer import TeSender, add_te_routes
from fastdeploy_r3.http_clients import async_client

ROOM_TTL_S = 600.0
MAX_ROOMS = 65536
LONG_POLL_S = 20.0  # one GET waits at most this long on P


class Rooms:
    """Handoffs by room, published by P's serving path and waited for by its bootstrap server."""

    def __init__(self, ttl_s: float = ROOM_TTL_S, max_rooms: int = MAX_ROOMS) -> None:
        self.ttl_s, self.max_rooms = ttl_s, max_rooms
        self._done: OrderedDict[int, tuple[float, Handoff]] = OrderedDict()
        self._waiting: dict[int, tuple[asyncio.Event, list[int]]] = {}  # room -> (event, [number of waiters])
        self.closed = False

    def close(self) -> None:
        """P is stopping: every long poll answers now (503), not when its wait runs out."""
        self.closed = True
        for event, _ in self._waiting.values():
            event.set()

    def publish(self, handoff: Handoff) -> None:
        now = time.monotonic()
        self._done[handoff.room] = (now, handoff)
        self._done.move_to_end(handoff.room)
        while self._done and (len(self._done) > self.max_rooms
                              or next(iter(self._done.values()))[0] < now - self.ttl_s):
            self._done.popitem(last=False)
        waiting = self._waiting.pop(handoff.room, None)
        if waiting is not None:
            waiting[0].set()

    def get(self, room: int) -> Handoff | None:
        entry = self._done.get(room)
        return None if entry is None else entry[1]

    async def wait(self, room: int, wait_s: float) -> Handoff | None:
        """The room's handoff, waiting up to wait_s for P to publish it; None if it did not."""
        found = self.get(room)
        if found is not None or wait_s <= 0 or self.closed:
            return found
        event, count = self._waiting.setdefault(room, (asyncio.Event(), [0]))
        count[0] += 1
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await event.wait()
        finally:
            count[0] -= 1
            if count[0] == 0 and self._waiting.get(room, (None,))[0] is event:
                del self._waiting[room]  # nobody waits on a room never published: nothing kept for it
        return self.get(room)

    def num_waiting(self) -> int:
        return len(self._waiting)


def bootstrap_app(rooms: Rooms, te: TeSender | None = None) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    if te is not None:
        add_te_routes(app, te)
        add_in_place_route(app, te)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/pd/rooms/{room}")
    async def room(room: int, wait_s: float = 0.0) -> JSONResponse:
        if not 0 <= room <= MAX_ROOM:
            return JSONResponse({"error": f"room {room} is not in [0, 2^64)"}, status_code=400)
        handoff = await rooms.wait(room, min(max(wait_s, 0.0), LONG_POLL_S))
        if handoff is None and rooms.closed:
            return JSONResponse({"error": "the prefill server is shutting down"}, status_code=503)
        if handoff is None:
            return JSONResponse({"pending": room}, status_code=404)
        return JSONResponse(handoff.to_json())

    return app


class BootstrapServer:
    """P's bootstrap server on its own port, in the API server's event loop."""

    def __init__(self, rooms: Rooms, host: str, port: int, te: TeSender | None = None) -> None:
        self.rooms = rooms
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
            self.sock.listen(128)  # now, so that a second server on the port fails here, by name
        except OSError as e:
            self.sock.close()
            raise OSError(f"--disaggregation-bootstrap-port {port}: cannot bind {host}:{port} ({e}); choose a free "
                          "port") from e
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(bootstrap_app(rooms, te), log_level="warning", lifespan="off"))
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign] - the API server's
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))

    async def close(self) -> None:
        self.rooms.close()
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(self.task, 5.0)
        self.sock.close()


async def fetch_handoff(boot: Bootstrap, deadline: float, connect_timeout_s: float = 2.0) -> Handoff:
    """D: the handoff of boot.room from P's bootstrap server, by loop time `deadline`.

    HandoffError when the server cannot be reached (after connect_timeout_s of refused connections:
    P may be restarting), answers something else than a handoff, or has not published the room by the
    deadline."""
    loop = asyncio.get_running_loop()
    url = f"http://{boot.host}:{boot.port}/pd/rooms/{boot.room}"
    unreachable_since: float | None = None
    async with async_client() as client:
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise HandoffError(f"the prefill server did not hand over room {boot.room} before the request's "
                                   "deadline")
            wait_s = min(left, LONG_POLL_S)
            try:
                r = await client.get(url, params={"wait_s": f"{wait_s:.3f}"}, timeout=wait_s + 5.0)
            except httpx.TransportError as e:
                now = loop.time()
                unreachable_since = now if unreachable_since is None else unreachable_since
                if now - unreachable_since >= connect_timeout_s:
                    raise HandoffError(f"the prefill bootstrap server {boot.host}:{boot.port} is unreachable "
                                       f"({type(e).__name__}); is the prefill server up, and is bootstrap_port its "
                                       "--disaggregation-bootstrap-port?") from None
                await asyncio.sleep(0.1)
                continue
            unreachable_since = None
            if r.status_code == 404:
                continue
            if r.status_code != 200:
                raise HandoffError(f"the prefill bootstrap server answered {r.status_code} for room {boot.room}: "
                                   f"{r.text[:200]}")
            try:
                body = r.json()
            except ValueError:
                raise HandoffError("the prefill bootstrap server answered a body that is not JSON") from None
            return Handoff.from_json(body)
