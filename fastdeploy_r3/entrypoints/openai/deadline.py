"""A request's deadline enforced on its stream of deltas, with one timer per request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from fastdeploy_r3.entrypoints.openai.errors import OpenAIError
from fastdeploy_r3.outputs import RequestDelta


async def bounded(
    request_id: str, gen: AsyncIterator[RequestDelta], deadline: float, release: Callable[[], None]
) -> AsyncIterator[RequestDelta]:
    """`gen` until `deadline`; past it the engine request is aborted and OpenAIError(504) raised.

    One timer per request, not one per delta (asyncio.timeout_at around each await cost ~6 % of
    the API server's CPU per streamed token): when it fires while this generator waits for the
    engine, it cancels that wait; when it fires while the consumer holds a delta (sending it), the
    next call here raises."""
    waiting: asyncio.Task | None = None  # the task awaiting the engine here (the first delta's and
    timed_out = False  # the later ones' are different tasks: the handler's, then the response's)

    def expire() -> None:
        nonlocal timed_out
        timed_out = True
        if waiting is not None:
            waiting.cancel()

    timer = asyncio.get_running_loop().call_at(deadline, expire)
    try:
        while not timed_out:
            waiting = asyncio.current_task()
            try:
                delta = await anext(gen)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not timed_out or waiting.uncancel() > 0:  # someone else's cancellation too
                    raise
                break
            finally:
                waiting = None
            yield delta
            if delta.finished:
                return
        raise OpenAIError(
            504, f"request {request_id} did not finish within its deadline and was aborted; send a "
            "larger `timeout` (seconds) or fewer max_tokens", "timeout_error", "timeout")
    finally:
        timer.cancel()
        try:
            await gen.aclose()  # aborts the engine request unless it finished
        finally:
            release()
