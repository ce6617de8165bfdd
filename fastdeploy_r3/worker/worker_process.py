"""Entry point of a worker process (one per TP rank), driven by the engine over a pipe.

    engine                         worker rank r
      ── spawn(config, rank) ──►     join the TP group, load this rank's shard, size + allocate KV cache
      ◄── WorkerReady(kv_spec) ──
      ── AttachRoutingBuffer ──►     rank 0 attaches routing_host_buffer
      ◄── RoutingAttached ──────
      ── StepInput ────────────►     forward, write R3 rows, sample (the next StepInput may be launched
      ◄── StepOutput ───────────     before this one's output goes back: StepPipeline)
      ── InitWeightUpdateGroup / UpdateWeights / DestroyWeightUpdateGroup ►  (between steps)
      ◄── WeightUpdateResult ───     new weights in place, each rank its shard
      ── ReleaseMemory / ResumeMemory / ChecksumWeights ►  ◄── MemoryResult / WeightsChecksum
      ── Shutdown / pipe closed ►    free SHM, leave the TP group, exit

Every rank runs every step (its forward all-reduces with the others); only rank 0 samples and writes R3.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import torch

from fastdeploy_r3.cache_manager.shm import unlink_all
from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.lifecycle import (
    exit_after,
    exit_when_orphaned,
    exit_with_parent,
    freeze_startup_heap,
    name_this_process,
    parent_gone,
    run_then_clean_up,
    unwind_on_sigterm,
)
from fastdeploy_r3.worker.messages import (
    AttachRoutingBuffer,
    ChecksumWeights,
    DestroyWeightUpdateGroup,
    ExpertDistribution,
    InitWeightUpdateGroup,
    RebalanceExperts,
    ReleaseMemory,
    ResumeMemory,
    RoutingAttached,
    Shutdown,
    StepInput,
    StepOutput,
    UpdateWeights,
    WorkerError,
    WorkerFailed,
    WorkerReady,
)

if TYPE_CHECKING:
    from fastdeploy_r3.worker.model_runner import LaunchedStep, ModelRunner

logger = logging.getLogger(__name__)


def worker_main(
    config: EngineConfig,
    rank: int,
    world_size: int,
    engine_suffix: str,
    conn: Connection,
    dist_init_method: str = "",
    runner_cls: type | None = None,
) -> None:
    """dist_init_method: the TP group's rendezvous (tcp://127.0.0.1:PORT); unused when world_size is 1.
    runner_cls: a ModelRunner subclass to run instead (one that feeds more than the chunk per step)."""
    from fastdeploy_r3.distributed.parallel_state import destroy_distributed

    # SIGTERM (from the engine's stop(), or from the kernel when the engine dies) unwinds into the
    # cleanup below, which frees this rank's SHM, whatever the rank was doing.
    signal.signal(signal.SIGTERM, unwind_on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the engine stops us
    engine = multiprocessing.parent_process()
    engine_pid = engine.pid if engine is not None else os.getppid()
    state = _RankState()

    def serve() -> None:
        try:
            _serve(state, config, rank, world_size, engine_pid, engine_suffix, conn, dist_init_method, runner_cls)
        except Exception as e:
            try:
                conn.send(WorkerFailed(rank, WorkerError.of(e), traceback.format_exc()))
            except Exception:
                pass

    def clean_up() -> None:
        # Not told to stop: the engine died (neither its pid nor getppid() may show it yet: the
        # parent-death signal comes when its thread exits, before the process is gone), or it is
        # stopping a stuck rank and will unlink them too (a second unlink is harmless).
        if not state.told_to_stop or parent_gone(engine_pid):
            unlink_all(engine_suffix)  # the engine died without shutting us down: nobody else will
        if state.runner is not None:
            state.runner.close()
        destroy_distributed()

    exit_after(lambda: run_then_clean_up(serve, clean_up))  # skips the finalization of a frozen heap


@dataclass
class _RankState:
    """What the cleanup of a rank needs to know: the runner to close, and whether the engine said stop."""

    runner: ModelRunner | None = None
    told_to_stop: bool = False


def _serve(state: _RankState, config: EngineConfig, rank: int, world_size: int, engine_pid: int, engine_suffix: str,
           conn: Connection, dist_init_method: str, runner_cls: type | None) -> None:  # fmt: skip
    """Start this rank and answer the engine's messages until Shutdown or the pipe closes; state.runner
    and state.told_to_stop tell the cleanup what there is to close."""
    from fastdeploy_r3.distributed.parallel_state import init_distributed
    from fastdeploy_r3.worker.model_runner import ModelRunner

    exit_with_parent(engine_pid)
    # a rank stuck in native I/O never runs the SIGTERM handler: exit anyway, segments unlinked
    exit_when_orphaned(engine_pid, lambda: unlink_all(engine_suffix))
    name_this_process(f"fdr3-worker{rank}")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    runner = state.runner = (runner_cls or ModelRunner)(config, rank, world_size, engine_suffix)
    init_distributed(rank, world_size, dist_init_method, config.device)
    runner.load_model()
    num_blocks = runner.determine_num_gpu_blocks()
    spec = runner.init_kv_cache(num_blocks)
    conn.send(WorkerReady(rank, num_blocks, spec, runner.num_lookahead_tokens))
    freeze_startup_heap()
    steps = StepPipeline(runner, conn, pipelined=pipelines(runner, world_size, config.device))
    while True:
        try:
            steps.wait_for_message()
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the engine is gone: the cleanup unlinks its segments
        if isinstance(msg, StepInput):
            steps.run(msg)
            continue
        steps.flush()  # a control message, or shutdown, comes after every step sent before it
        if isinstance(msg, Shutdown):
            state.told_to_stop = True
            return
        if isinstance(msg, AttachRoutingBuffer):
            runner.attach_routing(msg.spec)
            runner.capture_decode_graphs()
            conn.send(RoutingAttached(rank))
        elif isinstance(msg, (InitWeightUpdateGroup, DestroyWeightUpdateGroup, UpdateWeights, ReleaseMemory,
                              ResumeMemory, ChecksumWeights, ExpertDistribution, RebalanceExperts)):
            conn.send(runner.control(msg))


def pipelines(runner: ModelRunner, world_size: int, device: str) -> bool:
    """Whether this rank launches the next step before finishing the one before (StepPipeline): one rank,
    a runner whose steps split into launch and finish, on a device where a launch returns early
    (pipeline_steps), and an engine that may send the next step first (engine/overlap.py plans it ahead),
    so that the device runs it while this process waits for, packs and sends the previous one. Never
    for a runner that verifies drafts (num_lookahead_tokens > 0): no step is planned ahead of a verify
    step, so the next one cannot come first; such a rank finishes each step at once, waiting on its
    event, instead of polling the pipe every POLL_S for a message that cannot come first (up to POLL_S
    added to every verify step)."""
    from fastdeploy_r3.worker.model_runner import ModelRunner

    return (world_size == 1 and runner.num_lookahead_tokens == 0 and type(runner).execute is ModelRunner.execute
            and pipeline_steps(device))


def pipeline_steps(device: str) -> bool:
    """Whether to launch a step before finishing the previous one: on CUDA, where a launch returns
    before the device is done. On the CPU a launch computes the whole step, so launching the next one
    first would only hold the previous output back; FDR3_PIPELINE_STEPS=1 forces it (tests of the
    ordering), =0 turns it off."""
    forced = os.environ.get("FDR3_PIPELINE_STEPS", "")
    return forced == "1" if forced in ("0", "1") else device == "cuda"


class StepPipeline:
    """At most one launched step waits for its finish while the next one is launched. Outputs go back
    in step order; a step that fails, in launch or in finish, answers with its error and the worker
    lives on (the engine fails or re-runs its requests)."""

    POLL_S = 0.0001  # how often the wait for "next message or device done" looks at both

    def __init__(self, runner: ModelRunner, conn: Connection, pipelined: bool) -> None:
        self.runner, self.conn, self.pipelined = runner, conn, pipelined
        self.pending: LaunchedStep | None = None

    def wait_for_message(self) -> None:
        """Return once a message is waiting; meanwhile finish the pending step if its device work is done."""
        while self.pending is not None and not self.conn.poll(self.POLL_S):
            if self.pending.done():
                self.flush()

    def run(self, step: StepInput) -> None:
        if not self.pipelined:
            self.conn.send(self._guarded(step.step_id, lambda: self.runner.execute(step)))
            return
        try:
            launched = self.runner.launch(step)
        except Exception as e:
            self.flush()
            self.conn.send(self._error(step.step_id, e))
            return
        launched.out.launched_ahead = self.pending is not None
        self.flush()
        self.pending = launched

    def flush(self) -> None:
        """Finish the pending step, if any, and send its output."""
        launched, self.pending = self.pending, None
        if launched is not None:
            self.conn.send(self._guarded(launched.out.step_id, lambda: self.runner.finish(launched)))

    def _guarded(self, step_id: int, fn: Callable[[], StepOutput]) -> StepOutput:
        try:
            return fn()
        except Exception as e:
            return self._error(step_id, e)

    @staticmethod
    def _error(step_id: int, e: Exception) -> StepOutput:
        """The engine fails the step's requests (or re-runs them one by one); the worker lives on."""
        logger.error("step %d failed", step_id, exc_info=e)
        return StepOutput(step_id, {}, error=WorkerError.of(e))
