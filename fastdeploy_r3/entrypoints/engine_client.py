"""The API server's handle on the engine process (engine/messages.py is the wire).

One reader task routes engine messages to per-request queues; one watchdog task notices an engine
that is gone or stalled and fails everything in flight with a message that says so. After that,
every call raises `EngineDeadError` and `on_dead` runs (the API server exits non-zero so that its
supervisor restarts it; a server without its engine would only answer 503 forever).

    dead      the engine process exited (crash, SIGKILL, OOM), or the reader task itself failed
    stalled   no message from the engine for `stall_timeout_s` although it is asked every second
              (SIGSTOP, a hung step): the engine is SIGKILLed, which its own children follow
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing.process
import os
import pickle
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq
import zmq.asyncio

from fastdeploy_r3.cache_manager.shm import remove_stale_segments
from fastdeploy_r3.cache_manager.transfer import RemoteBlocks
from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.engine.detokenizer import DeltaDetokenizer
from fastdeploy_r3.engine.engine_process import EngineAddresses, run_engine_process
from fastdeploy_r3.engine.messages import (
    AbortRequest,
    AddRequest,
    ControlCommand,
    ControlReply,
    ControlRequest,
    EngineCrashed,
    EngineInfo,
    EngineReady,
    EngineStartupFailed,
    ErrorKind,
    HealthQuery,
    HealthReply,
    MetricsQuery,
    MetricsReply,
    OutputBatch,
    RequestRejected,
    Shutdown,
)
from fastdeploy_r3.engine.zmq_frames import loads_frames
from fastdeploy_r3.lifecycle import EngineDeadError, remove_stale_ipc_dirs
from fastdeploy_r3.outputs import RequestDelta
from fastdeploy_r3.sampling_params import InvalidRequestError, SamplingParams
from fastdeploy_r3.spawn import start_process

logger = logging.getLogger(__name__)

_WATCHDOG_PERIOD_S = 0.5
_HEARTBEAT_PERIOD_S = 1.0
# A send the engine does not take within this is refused with an error (its input queue is full).
_SEND_TIMEOUT_S = 10.0


class EngineStartupError(RuntimeError):
    """The engine process could not start; the message carries its cause."""


class EngineRequestError(RuntimeError):
    """The engine refused a request for a reason other than bad input."""


class EngineUnavailableError(EngineRequestError):
    """The engine is alive but cannot serve now (memory released, weights missing or broken): HTTP 503."""


class EngineOverloadedError(RuntimeError):
    """The engine's waiting queue is full; retry the request later (HTTP 429)."""


class EngineWeightVersionError(EngineRequestError):
    """The request named the weight version it must run on, and the engine holds another."""


# what a RequestRejected of each kind raises in the caller of generate()
_REJECTIONS: dict[ErrorKind, type[Exception]] = {
    ErrorKind.INVALID: InvalidRequestError,
    ErrorKind.OVERLOADED: EngineOverloadedError,
    ErrorKind.FAILED: EngineRequestError,
    ErrorKind.UNAVAILABLE: EngineUnavailableError,
    ErrorKind.WEIGHT_VERSION: EngineWeightVersionError,
}


class AsyncEngineClient:
    """Starts the engine process and talks to it; create with `await AsyncEngineClient.start(config)`."""

    def __init__(self, config: EngineConfig, tokenizer: Any = None, stall_timeout_s: float | None = None) -> None:
        """stall_timeout_s: default the worker step deadline + 30 s (a step may legitimately take that long)."""
        self.config = config
        self.tokenizer = tokenizer
        self.info: EngineInfo | None = None
        self.dead_message: str | None = None
        self.on_dead: Callable[[str], None] | None = None
        self.stall_timeout_s = (
            stall_timeout_s if stall_timeout_s is not None else config.parallel_config.worker_step_timeout_s + 30.0
        )
        self._last_heard = 0.0
        for path in remove_stale_ipc_dirs():
            logger.warning("removed IPC directory %s left by a server that is gone", path)
        self._addresses = EngineAddresses.new()
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._output = self._ctx.socket(zmq.PULL)
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    # -- life cycle -------------------------------------------------------------------------------

    @classmethod
    async def start(
        cls, config: EngineConfig, tokenizer: Any = None, timeout_s: float = 900.0, stall_timeout_s: float | None = None
    ) -> AsyncEngineClient:
        client = cls(config, tokenizer, stall_timeout_s)
        try:
            await client._start(timeout_s)
        except BaseException:
            await client.shutdown()
            raise
        return client

    async def _start(self, timeout_s: float) -> None:
        # spawn: the engine must not inherit this process's event loop, threads or sockets; not a
        # daemon, because the engine starts worker processes of its own
        self._proc = start_process(
            run_engine_process, (self.config, self._addresses, os.getpid(), self.tokenizer is not None),
            name="fdr3-engine", daemon=False
        )
        self._output.connect(self._addresses.output)
        self._input.connect(self._addresses.input)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if await self._output.poll(200):
                msg = loads_frames(await self._output.recv_multipart(copy=False))
                if isinstance(msg, EngineReady):
                    self.info = msg.info
                    break
                if isinstance(msg, EngineStartupFailed):
                    raise EngineStartupError(f"engine failed to start: {msg.message}\n{msg.traceback}")
                raise EngineStartupError(f"engine sent {type(msg).__name__} before it was ready")
            if not self._proc.is_alive():
                raise EngineStartupError(f"engine process exited with code {self._proc.exitcode} during start-up")
            if loop.time() > deadline:
                raise EngineStartupError(f"engine did not become ready within {timeout_s:.0f} s")
        self._last_heard = loop.time()
        self._tasks = [
            asyncio.create_task(self._read_outputs(), name="fdr3-engine-reader"),
            asyncio.create_task(self._watch_process(), name="fdr3-engine-watchdog"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._on_task_done)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        proc = self._proc
        if proc is not None and proc.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                await self._input.send(pickle.dumps(Shutdown()))
            await asyncio.get_running_loop().run_in_executor(None, proc.join, timeout_s)
            if proc.is_alive():
                proc.terminate()  # SIGTERM: the engine process still runs EngineService.shutdown()
                await asyncio.get_running_loop().run_in_executor(None, proc.join, 10.0)
            if proc.is_alive():
                proc.kill()
        self._fail_all(EngineDeadError("the server is shutting down"))
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        self._addresses.remove()

    # -- engine liveness --------------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self.dead_message is None and not self._closed

    def _mark_dead(self, message: str) -> None:
        first = self.dead_message is None
        if first:
            self.dead_message = message
            logger.error("engine unavailable: %s", message)
        self._fail_all(EngineDeadError(self.dead_message))
        if first and not self._closed and self.on_dead is not None:
            self.on_dead(message)

    def _on_task_done(self, task: asyncio.Task) -> None:
        # Without its reader or watchdog no request would ever finish: that is the engine lost too.
        if task.cancelled() or self._closed:
            return
        exc = task.exception()
        why = f"{type(exc).__name__}: {exc}" if exc is not None else "it returned"
        self._mark_dead(f"the server's {task.get_name()} task stopped ({why})")

    def _fail_all(self, error: BaseException) -> None:
        for q in self._queues.values():
            q.put_nowait(error)
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(error)
        self._replies.clear()

    def fail_in_flight(self, message: str) -> int:
        """Answer every request this server waits on with EngineDeadError(message): a server stopping
        with requests held (paused, or longer than its grace window) tells them why. Returns how many."""
        n = len(self._queues)
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(message))
        return n

    def _check_alive(self) -> None:
        if self.dead_message is not None:
            raise EngineDeadError(self.dead_message)
        if self._closed:
            raise EngineDeadError("the server is shutting down")

    async def _watch_process(self) -> None:
        proc = self._proc
        assert proc is not None
        loop = asyncio.get_running_loop()
        next_ping = 0.0
        prev = loop.time()
        while proc.is_alive():
            now = loop.time()
            if now - prev > 4 * _WATCHDOG_PERIOD_S + 1.0:
                # this process itself was not running (SIGSTOP, swapped out): the engine's answers are
                # still unread, so its silence starts counting again now
                self._last_heard = now
            prev = now
            silent = now - self._last_heard
            if silent > self.stall_timeout_s:
                proc.kill()  # SIGKILL works on a stopped process too; its children follow it (exit_with_parent)
                await loop.run_in_executor(None, proc.join, 10.0)
                remove_stale_segments()  # named after the engine's pid, which is gone now
                self._mark_dead(
                    f"engine process (pid {proc.pid}) did not answer for {silent:.0f} s (stopped or stuck "
                    f"past stall_timeout_s={self.stall_timeout_s:g}); it was killed"
                )
                return
            if now >= next_ping:
                # the engine answers between steps: any message it sends proves the loop moves
                next_ping = now + _HEARTBEAT_PERIOD_S
                with contextlib.suppress(zmq.ZMQError, asyncio.TimeoutError):
                    await asyncio.wait_for(self._send(HealthQuery(-1)), _HEARTBEAT_PERIOD_S)
            await asyncio.sleep(_WATCHDOG_PERIOD_S)
        # let the reader deliver what the engine sent before it died (e.g. EngineCrashed's cause)
        await asyncio.sleep(_WATCHDOG_PERIOD_S)
        remove_stale_segments()
        self._mark_dead(f"engine process (pid {proc.pid}) exited with code {proc.exitcode}")

    async def _read_outputs(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            msg = loads_frames(await self._output.recv_multipart(copy=False))
            self._last_heard = loop.time()
            if isinstance(msg, OutputBatch):
                for out in msg.unpack():
                    q = self._queues.get(out.request_id)
                    if q is not None:  # None: the caller went away and aborted
                        q.put_nowait(out)
            elif isinstance(msg, RequestRejected):
                q = self._queues.get(msg.request_id)
                if q is not None:
                    q.put_nowait(_REJECTIONS[msg.kind](msg.message))
            elif isinstance(msg, (MetricsReply, HealthReply, ControlReply)):
                fut = self._replies.pop(msg.query_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, EngineCrashed):
                self._mark_dead(msg.message)

    # -- requests ---------------------------------------------------------------------------------

    async def _send(self, msg: object) -> None:
        try:
            await asyncio.wait_for(self._input.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)),
                                   _SEND_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise EngineRequestError(
                f"the engine did not take a message within {_SEND_TIMEOUT_S:g} s (its input queue is full); retry later"
            ) from None

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        rewrite: Callable[[RequestDelta], RequestDelta] | None = None,
        weight_version: str | None = None,
        remote_blocks: RemoteBlocks | None = None,
        keep_prompt_tail: bool = False,
        peer_prompt_tokens: int = 0,
    ) -> AsyncIterator[RequestDelta]:
        """Yield the RequestDelta of each step that advanced the request (what is new: assemble
        with outputs.OutputAssembler), ending with the finished one. Raises InvalidRequestError
        (bad input), EngineRequestError or EngineDeadError. Leaving the iteration early aborts the
        request in the engine. `rewrite` sees each delta before it is detokenized (a decode server puts
        the first token a prefill server sampled in front: entrypoints/pd/roles.py). `weight_version`: the
        engine refuses the request (EngineWeightVersionError) unless it holds these weights; `remote_blocks`: a
        prefill server writes the prompt's blocks into the engine's (PD); `keep_prompt_tail`,
        `peer_prompt_tokens`: the prompt's partial last block, stored as a prefill server's request ends,
        loaded by a decode server's (AddRequest)."""
        self._check_alive()
        if request_id in self._queues:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        # the engine left the text of requests without stop strings to this process (off its loop)
        detok = DeltaDetokenizer(self.tokenizer, params) if self.tokenizer is not None else None
        finished = False
        try:
            await self._send(AddRequest(request_id, list(prompt_token_ids), params, prompt, weight_version,
                                        remote_blocks, keep_prompt_tail, peer_prompt_tokens))
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True  # rejected or dead: nothing to abort
                    raise item
                finished = item.finished
                item = item if rewrite is None else rewrite(item)
                yield item if detok is None else detok.fill(item)
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.is_alive:
                self._abort_now(request_id)

    def queued(self, request_id: str) -> int:
        """Deltas of the request that arrived and were not yet taken by its generate() (0 if unknown)."""
        q = self._queues.get(request_id)
        return 0 if q is None else q.qsize()

    def _abort_now(self, request_id: str) -> None:
        """Send an abort without awaiting: the caller may be a task being cancelled (a client that
        disconnected), where any await would raise again before the message left. A zmq.asyncio
        send is attempted at once; only a full pipe defers it to the loop."""
        with contextlib.suppress(zmq.ZMQError):
            sent = self._input.send(pickle.dumps(AbortRequest(request_id), protocol=pickle.HIGHEST_PROTOCOL))
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieve, never raise later

    async def _query(self, make_msg: Callable[[int], object], timeout_s: float) -> Any:
        """Send make_msg(query_id) and wait for the reply carrying that query_id."""
        self._check_alive()
        query_id = next(self._query_ids)
        fut = asyncio.get_running_loop().create_future()
        self._replies[query_id] = fut
        try:
            await self._send(make_msg(query_id))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._replies.pop(query_id, None)

    async def control(self, command: ControlCommand, timeout_s: float = 3600.0) -> ControlReply:
        """Run an RL control command in the engine (between two steps) and return its answer."""
        return await self._query(lambda query_id: ControlRequest(query_id, command), timeout_s)

    async def abort(self, request_id: str, message: str | None = None) -> None:
        if self.is_alive:
            await self._send(AbortRequest(request_id, message))

    def in_flight_request_ids(self) -> list[str]:
        """Requests this server is waiting on."""
        return list(self._queues)

    async def metrics(self, timeout_s: float = 30.0) -> dict[str, float]:
        reply: MetricsReply = await self._query(MetricsQuery, timeout_s)
        return reply.metrics

    async def check_health(self, timeout_s: float = 30.0) -> dict[str, str]:
        """What of the engine is degraded ({} when all is well); EngineDeadError unless the engine answers."""
        try:
            reply: HealthReply = await self._query(HealthQuery, timeout_s)
        except TimeoutError as e:
            raise EngineDeadError(f"engine did not answer a health check within {timeout_s:.0f} s") from e
        if not reply.ok:
            raise EngineDeadError(reply.message)
        return dict(reply.degraded)
