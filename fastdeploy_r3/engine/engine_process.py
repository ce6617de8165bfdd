"""The engine in its own process, driven over ZMQ by the API server (docs/architecture.md, "Processes").

    api_server ──PUSH  {ipc_dir}/input ──►  PULL  engine process (EngineService)
    api_server ◄─PULL  {ipc_dir}/output ◄── PUSH
                         EngineReady | EngineStartupFailed, then OutputBatch / RequestRejected /
                         MetricsReply / HealthReply / ControlReply

Messages are the typed dataclasses of engine/messages.py, pickled (outputs: engine/zmq_frames.py). The loop
blocks on the input socket while idle and steps while it has work, draining input between steps. It exits when
told to, when its parent dies, or after an unexpected error (reported first: in-flight requests fail with it).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.engine.kv_integrity import integrity_reply
from fastdeploy_r3.engine.messages import (
    AbortRequest,
    AddRequest,
    AwaitWriteThrough,
    CheckIntegrity,
    ContinueGeneration,
    ControlReply,
    ControlRequest,
    EngineCrashed,
    EngineInfo,
    EngineReady,
    EngineStartupFailed,
    EngineState,
    EngineStateQuery,
    ErrorKind,
    ExpertDistributionRecord,
    ExpertPlacementReport,
    ExpertRebalance,
    FlushCache,
    HealthQuery,
    HealthReply,
    MetricsQuery,
    MetricsReply,
    OutputBatch,
    PauseGeneration,
    ReleaseMemoryOccupation,
    RequestRejected,
    ResumeMemoryOccupation,
    UpdateWeightVersion,
    WeightsCheck,
    WeightUpdate,
    WeightUpdateSession,
)
from fastdeploy_r3.engine.scheduler import QueueFullError
from fastdeploy_r3.engine.step_counters import Stopwatch
from fastdeploy_r3.engine.write_through import WriteThroughWaits
from fastdeploy_r3.engine.zmq_frames import dumps_frames
from fastdeploy_r3.lifecycle import (
    EngineDeadError,
    Shutdown,
    cleanup_begins,
    exit_after,
    exit_with_parent,
    freeze_startup_heap,
    name_this_process,
    new_ipc_dir,
    parent_gone,
    unwind_on_sigterm,
)
from fastdeploy_r3.sampling_params import InvalidRequestError
from fastdeploy_r3.worker.messages import DestroyWeightUpdateGroup, InitWeightUpdateGroup

if TYPE_CHECKING:
    from fastdeploy_r3.engine.engine_service import EngineService

# How often an idle engine wakes to check that its parent is still alive.
_IDLE_POLL_MS = 500
_WRITE_THROUGH_POLL_MS = 2  # an idle loop with a write-through wait polls the saves this often
# How often an engine busy in a control call tells the API server it is alive
_CONTROL_HEARTBEAT_S = 1.0
# One attempt to hand a message to the API server; retried while the server lives (it may be slow or
# stopped), given up the moment it is gone, so the engine never blocks in a send.
SEND_TIMEOUT_MS = 1000


class ParentGoneError(RuntimeError):
    """The API server that started this engine is gone; nobody will read its outputs."""


def send_while_parent_lives(sock: zmq.Socket, msg: object, parent_pid: int) -> None:
    frames = dumps_frames(msg)  # large arrays (R3 rows) out of band, not copied (engine/zmq_frames.py)
    while True:
        try:
            sock.send_multipart(frames, copy=False)  # SNDTIMEO bounds each attempt; all parts or none
            return
        except zmq.Again:
            if os.getppid() != parent_pid:
                raise ParentGoneError(f"the API server (pid {parent_pid}) is gone") from None


@dataclass(frozen=True)
class EngineAddresses:
    ipc_dir: str

    @property
    def input(self) -> str:
        return f"ipc://{self.ipc_dir}/input"

    @property
    def output(self) -> str:
        return f"ipc://{self.ipc_dir}/output"

    @classmethod
    def new(cls) -> EngineAddresses:
        # a unique, private (0700) directory named after the API server: two engines never share a
        # socket, and a start-up sweep removes the directories of servers that were SIGKILLed
        return cls(new_ipc_dir())

    def remove(self) -> None:
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _engine_info(svc: EngineService) -> EngineInfo:
    rr = svc.config.routing_replay_config
    return EngineInfo(
        pid=os.getpid(),
        max_model_len=svc.max_model_len,
        moe_layer_ids=list(rr.moe_layer_ids or []),
        num_experts=rr.num_experts,
        moe_top_k=rr.moe_top_k,
        routing_dtype=None if rr.routing_dtype is None else str(rr.routing_dtype),
        enable_routing_replay=rr.enable_routing_replay,
    )


class _EngineLoop:
    def __init__(self, svc: EngineService, input_sock: zmq.Socket, output_sock: zmq.Socket, parent_pid: int) -> None:
        self.svc = svc
        self.input_sock = input_sock
        self.output_sock = output_sock
        self.parent_pid = parent_pid
        self.running = True
        self._deferred: list[object] = []  # what arrived during a control call, handled after it
        self._last_beat = 0.0
        self.write_through = WriteThroughWaits()
        svc.control.heartbeat = self._control_heartbeat

    def _control_heartbeat(self) -> None:
        """While the workers carry out a control call (a long load, a rendezvous): answer health and state
        queries so that the stall watchdog and /health see a live engine; keep every other message for later."""
        now = time.monotonic()
        if now - self._last_beat < _CONTROL_HEARTBEAT_S:
            return
        self._last_beat = now
        while True:
            try:
                data = self.input_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = pickle.loads(data)
            if isinstance(msg, HealthQuery):
                self.send(self._health(msg))
            elif isinstance(msg, ControlRequest) and isinstance(msg.command, EngineStateQuery):
                self.send(ControlReply(msg.query_id, True, "ok", self._state(), False))  # read-only: /health asks it
            else:
                self._deferred.append(msg)
        self.send(HealthReply(-1, ok=True))  # unsolicited: proves the loop is alive

    def _health(self, msg: HealthQuery) -> HealthReply:
        return HealthReply(msg.query_id, ok=True, degraded={**self.svc.degraded(), **self.svc.control.health()})

    def send(self, msg: object) -> None:
        send_while_parent_lives(self.output_sock, msg, self.parent_pid)

    def handle(self, msg: object) -> None:
        from fastdeploy_r3.engine.control_error import EngineControlError, WeightVersionError

        if isinstance(msg, AddRequest):
            try:
                self.svc.add_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.prompt, msg.weight_version,
                                     msg.remote_blocks, msg.keep_prompt_tail, msg.peer_prompt_tokens)
            except (WeightVersionError, InvalidRequestError) as e:
                kind = ErrorKind.WEIGHT_VERSION if isinstance(e, WeightVersionError) else ErrorKind.INVALID
                self.send(RequestRejected(msg.request_id, str(e), kind))
            except QueueFullError as e:
                self.send(RequestRejected(msg.request_id, str(e), ErrorKind.OVERLOADED))
            except EngineControlError as e:  # weights broken or memory released: 503 with the reason
                self.send(RequestRejected(msg.request_id, str(e), ErrorKind.UNAVAILABLE))
            except Exception as e:  # noqa: BLE001 - the engine refused it; other requests are unaffected
                self.send(RequestRejected(msg.request_id, f"{type(e).__name__}: {e}", ErrorKind.FAILED))
        elif isinstance(msg, AbortRequest):
            self.svc.abort_request(msg.request_id, msg.message)
        elif isinstance(msg, MetricsQuery):
            self.send(MetricsReply(msg.query_id, {k: float(v) for k, v in self.svc.metrics().items()}))
        elif isinstance(msg, HealthQuery):
            self.send(self._health(msg))
        elif isinstance(msg, ControlRequest) and isinstance(msg.command, AwaitWriteThrough):
            self.write_through.add(msg.query_id, self.svc.kv)  # answered by run() once its saves are done
        elif isinstance(msg, ControlRequest):
            self.send(self.control(msg))
        elif isinstance(msg, Shutdown):
            self.running = False
        else:
            raise TypeError(f"engine process got an unknown message {type(msg).__name__}")

    def control(self, msg: ControlRequest) -> ControlReply:
        from fastdeploy_r3.engine.control import EngineControlError

        ctl = self.svc.control
        cmd = msg.command
        try:
            if isinstance(cmd, PauseGeneration):
                n = ctl.pause(cmd.mode)
                message = f"generation paused ({cmd.mode}); {n} requests {'aborted' if cmd.mode == 'abort' else 'held'}"
            elif isinstance(cmd, ContinueGeneration):
                ctl.resume()
                message = "generation continued"
            elif isinstance(cmd, FlushCache):
                message = f"cache flushed: {ctl.flush_cache()} cached blocks forgotten"
            elif isinstance(cmd, EngineStateQuery):
                message = "ok"
            elif isinstance(cmd, CheckIntegrity):
                return integrity_reply(self.svc.kv, msg.query_id, self._state(), len(self.svc.request_ids()))
            elif isinstance(cmd, WeightUpdate):
                version = ctl.update_weights(cmd.source, cmd.weight_version, cmd.abort_all_requests, cmd.force)
                message = (f"weights updated; weight_version is {version}" if ctl.last_update_reloaded else
                           f"weight_version {version!r} is already current; nothing reloaded (force: true reloads)")
            elif isinstance(cmd, (UpdateWeightVersion, ReleaseMemoryOccupation, ResumeMemoryOccupation, WeightsCheck,
                                  WeightUpdateSession, ExpertDistributionRecord, ExpertRebalance)):
                return self.rl_control(msg)
            elif isinstance(cmd, InitWeightUpdateGroup):
                ctl.init_weight_update_group(cmd)
                message = f"joined weight update group {cmd.group_name!r}"
            elif isinstance(cmd, DestroyWeightUpdateGroup):
                ctl.destroy_weight_update_group(cmd)
                message = f"left weight update group {cmd.group_name!r}"
            else:
                raise EngineControlError(f"unknown control command {type(cmd).__name__}")
            ok, invalid = True, False
        except EngineControlError as e:
            ok, invalid, message = False, e.invalid, str(e)
            return ControlReply(msg.query_id, ok, message, self._state(), invalid, e.status)
        return ControlReply(msg.query_id, ok, message, self._state(), invalid)

    def _state(self) -> EngineState:
        return EngineState(self.svc.weight_version, self.svc.control.paused, len(self.svc.request_ids()))

    def rl_control(self, msg: ControlRequest) -> ControlReply:
        """The colocated-training and version commands (engine/control.py, engine/memory_control.py)."""
        from fastdeploy_r3.engine.control import EngineControlError

        ctl, cmd, report, ok = self.svc.control, msg.command, None, True
        try:
            if isinstance(cmd, UpdateWeightVersion):
                changed = ctl.update_weight_version(cmd.new_version, cmd.abort_all_requests)
                message = (f"weight_version is {cmd.new_version}" if changed else
                           f"weight_version {cmd.new_version!r} is already current; nothing changed")
            elif isinstance(cmd, ReleaseMemoryOccupation):
                message, report = ctl.memory.release(cmd.tags)
            elif isinstance(cmd, ResumeMemoryOccupation):
                message, report = ctl.memory.resume(cmd.tags)
            elif isinstance(cmd, WeightsCheck):
                ok, message, report = ctl.check_weights(cmd.action, cmd.skip)
            elif isinstance(cmd, ExpertDistributionRecord):
                message, report = ctl.expert_distribution(cmd.action)
            elif isinstance(cmd, ExpertRebalance):
                message, p2l = ctl.rebalance_experts()
                report = ExpertPlacementReport(p2l)
            else:
                assert isinstance(cmd, WeightUpdateSession)
                was, ctl.update_session_open = ctl.update_session_open, cmd.begin
                message = ("weight update session " + ("opened" if cmd.begin else "closed") +
                           ("" if was != cmd.begin else " (it already was)") +
                           "; weights load unpacked and need no post-processing on this engine")
        except EngineControlError as e:
            return ControlReply(msg.query_id, False, str(e), self._state(), e.invalid, e.status)
        # a "compare" that finds differences is an answer, not a failure: 200 with success false
        return ControlReply(msg.query_id, ok, message, self._state(), status=200, report=report)

    def drain(self, block_ms: int) -> None:
        """Handle every queued message; wait up to `block_ms` for the first one."""
        if self.input_sock.poll(block_ms) == 0:
            return
        while self.running:
            try:
                data = self.input_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle(pickle.loads(data))

    def run(self) -> None:
        while self.running:
            if os.getppid() != self.parent_pid:
                return  # orphaned, busy or not: nobody will read our outputs
            while self._deferred and self.running:
                self.handle(self._deferred.pop(0))
            busy = self.svc.has_work()
            self.drain(0 if busy else _WRITE_THROUGH_POLL_MS if self.write_through.pending() else _IDLE_POLL_MS)
            if not self.running:
                return
            for query_id in self.write_through.ready(self.svc.kv):
                self.send(ControlReply(query_id, True, "write-through done", self._state()))
            if self.svc.has_work():
                steps_before = self.svc.step_counters.steps
                try:
                    outputs = self.svc.step()
                except EngineDeadError as e:
                    # a child of the engine died: the engine failed every in-flight request
                    self.send(OutputBatch.of(self.svc.fail_all()))
                    self.send(EngineCrashed(str(e)))
                    return
                if outputs:
                    watch = Stopwatch()
                    self.send(OutputBatch.of(outputs))
                    if self.svc.step_counters.steps != steps_before:  # a model step's outputs
                        self.svc.step_counters.add_send(watch.lap())


def run_engine_process(config: EngineConfig, addresses: EngineAddresses, parent_pid: int,
                       server_detokenizes: bool = False) -> None:
    """Entry point of the spawned engine process. server_detokenizes: the API server turns the token ids
    of requests without stop strings into text (engine/detokenizer.py DeltaDetokenizer), off this loop."""
    # The API server drives shutdown (Ctrl-C reaches the whole process group); SIGTERM sent to this process
    # alone, or by the kernel when the API server dies (exit_with_parent), must still run shutdown().
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, unwind_on_sigterm)

    def life() -> None:
        try:
            exit_with_parent(parent_pid)
            name_this_process("fdr3-engine")
            _serve(config, addresses, parent_pid, server_detokenizes)
        finally:
            # a signal: the API server died (its parent-death SIGTERM may come before it has quite exited),
            # or it stops this engine and removes the directory too (harmlessly twice)
            if isinstance(sys.exc_info()[1], SystemExit) or parent_gone(parent_pid):
                addresses.remove()

    exit_after(life)  # all shut down by then: the finalization of a frozen heap is skipped


def _serve(config: EngineConfig, addresses: EngineAddresses, parent_pid: int, server_detokenizes: bool) -> None:
    ctx = zmq.Context()
    input_sock = ctx.socket(zmq.PULL)
    input_sock.bind(addresses.input)
    output_sock = ctx.socket(zmq.PUSH)
    output_sock.setsockopt(zmq.LINGER, 2000)
    output_sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    output_sock.bind(addresses.output)

    def send(msg: object) -> None:  # one attempt: for last words that nobody may be left to read
        output_sock.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        # imported here: the API server imports this module for the message types only
        from fastdeploy_r3.engine.engine_service import EngineService

        svc = EngineService(config)
        svc.token_processor.detokenize_all = not server_detokenizes
    except BaseException as e:  # noqa: BLE001 - any start-up failure is reported to the API server
        with contextlib.suppress(zmq.ZMQError):
            send(EngineStartupFailed(f"{type(e).__name__}: {e}", traceback.format_exc()))
        output_sock.close()
        input_sock.close(linger=0)
        ctx.term()
        return
    try:
        send_while_parent_lives(output_sock, EngineReady(_engine_info(svc)), parent_pid)
        freeze_startup_heap()
        _EngineLoop(svc, input_sock, output_sock, parent_pid).run()
    except ParentGoneError:
        pass  # the API server died while this engine waited to hand it something
    except SystemExit:
        with contextlib.suppress(zmq.ZMQError):
            send(EngineCrashed("the engine process was terminated by a signal"))
        raise
    except BaseException as e:
        # report before dying so that the API server fails in-flight requests with the cause
        with contextlib.suppress(zmq.ZMQError):
            send(EngineCrashed(f"engine loop failed: {type(e).__name__}: {e}"))
        traceback.print_exc()
        raise
    finally:
        cleanup_begins()
        try:
            svc.shutdown()
        finally:
            # an orphan has nobody to flush its last messages to
            output_sock.close(linger=0 if os.getppid() != parent_pid else None)
            input_sock.close(linger=0)
            ctx.term()
