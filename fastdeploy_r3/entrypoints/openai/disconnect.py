"""Abort a request whose HTTP client went away (issue 11, F3).

A non-streaming endpoint awaits the whole generation before it writes a byte, so nothing tells it
that the client hung up: FastAPI does not cancel a handler on disconnect. `unless_disconnected`
runs the handler beside a listener on the ASGI receive channel; once the body has been read, the
next message that channel yields is `http.disconnect` (the client left, or the response was sent).
A disconnect first cancels the handler, whose generator then aborts the request in the engine, which
frees its blocks at its next step.

Streaming responses need no help: Starlette's StreamingResponse listens for the disconnect itself and
cancels the stream, and the stream's generator aborts the request the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready; its request was aborted."""


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client of `request` disconnects (call only after its body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        logger.info("client of %s disconnected; its request was aborted", request.url.path)
        raise ClientDisconnected(request.url.path)
    finally:
        for t in (task, listener):
            if not t.done():
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t


async def unless_gone(request: Request, work: Awaitable[Response]) -> Response:
    """The response of `work`, or 499 (nginx's "client closed request"; nobody reads it) when the
    client hung up first and its request was aborted. Every non-streaming generation endpoint uses it."""
    try:
        return await unless_disconnected(request, work)
    except ClientDisconnected:
        return Response(status_code=499)
