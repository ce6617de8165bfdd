"""Entry point of a worker process (one per TP rank), driven by the engine over a pipe.

    engine                         worker rank r
      ── spawn(config, rank) ──►     join the TP group, load this rank's shard, size + allocate KV cache
      ◄── WorkerReady(kv_spec) ──
      ── AttachRoutingBuffer ──►     rank 0 attaches routing_host_buffer
      ◄── True ─────────────────
      ── StepInput ────────────►     forward, write R3 rows, sample
      ◄── StepOutput ───────────
      ── InitWeightUpdateGroup / UpdateWeights / DestroyWeightUpdateGroup ►  (between steps)
      ◄── WeightUpdateResult ───     new weights in place, each rank its shard
      ── Shutdown / pipe closed ►    free SHM, leave the TP group, exit

Every rank runs every step (its forward all-reduces with the others); only rank 0 samples and writes R3.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import traceback
from multiprocessing.connection import Connection

import torch

from fastdeploy_r3.cache_manager.shm import unlink_all
from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.lifecycle import (
    cleanup_begins,
    exit_with_parent,
    name_this_process,
    parent_gone,
    unwind_on_sigterm,
)
from fastdeploy_r3.worker.messages import (
    AttachRoutingBuffer,
    DestroyWeightUpdateGroup,
    InitWeightUpdateGroup,
    Shutdown,
    StepInput,
    StepOutput,
    UpdateWeights,
    WorkerReady,
)

logger = logging.getLogger(__name__)


def worker_main(
    config: EngineConfig,
    rank: int,
    world_size: int,
    engine_suffix: str,
    conn: Connection,
    dist_init_method: str = "",
) -> None:
    """dist_init_method: the TP group's rendezvous (tcp://127.0.0.1:PORT); unused when world_size is 1."""
    from fastdeploy_r3.distributed.parallel_state import destroy_distributed, init_distributed
    from fastdeploy_r3.worker.model_runner import ModelRunner

    # SIGTERM (from the engine's stop(), or from the kernel when the engine dies) unwinds into the
    # finally below, which frees this rank's SHM, whatever the rank was doing.
    signal.signal(signal.SIGTERM, unwind_on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the engine stops us
    engine = multiprocessing.parent_process()
    engine_pid = engine.pid if engine is not None else os.getppid()
    runner = None
    told_to_stop = False
    try:
        exit_with_parent(engine_pid)
        name_this_process(f"fdr3-worker{rank}")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        runner = ModelRunner(config, rank, world_size, engine_suffix)
        init_distributed(rank, world_size, dist_init_method, config.device)
        runner.load_model()
        num_blocks = runner.determine_num_gpu_blocks()
        spec = runner.init_kv_cache(num_blocks)
        conn.send(WorkerReady(rank, num_blocks, spec))
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break  # the engine is gone: the finally below unlinks its segments
            if isinstance(msg, Shutdown):
                told_to_stop = True
                break
            if isinstance(msg, AttachRoutingBuffer):
                runner.attach_routing(msg.spec)
                runner.capture_decode_graphs()
                conn.send(True)
            elif isinstance(msg, StepInput):
                try:
                    out = runner.execute(msg)
                except Exception as e:  # the engine fails the step's requests, the worker lives on
                    logger.exception("step %d failed", msg.step_id)
                    out = StepOutput(msg.step_id, {}, error=f"{type(e).__name__}: {e}")
                conn.send(out)
            elif isinstance(msg, (InitWeightUpdateGroup, DestroyWeightUpdateGroup, UpdateWeights)):
                conn.send(runner.weight_control(msg))
    except Exception as e:
        try:
            conn.send(RuntimeError(f"worker rank {rank} failed to start: {e}\n{traceback.format_exc()}"))
        except Exception:
            pass
    finally:
        cleanup_begins()
        # Not told to stop: the engine died (neither its pid nor getppid() may show it yet: the
        # parent-death signal comes when its thread exits, before the process is gone), or it is
        # stopping a stuck rank and will unlink them too (a second unlink is harmless).
        if not told_to_stop or parent_gone(engine_pid):
            unlink_all(engine_suffix)  # the engine died without shutting us down: nobody else will
        if runner is not None:
            runner.close()
        destroy_distributed()

