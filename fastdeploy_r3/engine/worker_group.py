"""The engine's worker processes, one per TP rank: start, broadcast, collect answers, supervise, stop.

Every message goes to all ranks and every rank answers; rank 0's answer carries the sampled
tokens. A rank that dies, or does not answer a step within its deadline (stuck, or stopped with
SIGSTOP), surfaces as EngineDeadError naming it; `stop()` then kills such a rank at once instead of
asking it politely.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.lifecycle import EngineDeadError, Shutdown
from fastdeploy_r3.worker.messages import WorkerFailed


@dataclass(frozen=True)
class PerRank:
    """One message per rank, in rank order, where the ranks need different ones (each rank's experts of a
    weight update under expert parallelism, engine/control.py): broadcast() sends rank r messages[r]."""

    messages: list[Any]


class WorkerGroup:
    def __init__(
        self, config: EngineConfig, engine_suffix: str, also_check: Callable[[], None] = lambda: None,
        runner_cls: type | None = None,
    ) -> None:
        """Spawn the ranks. `also_check` runs while waiting for answers (the engine's other children);
        runner_cls: the ranks' model runner, ModelRunner unless given (importable by the spawned ranks)."""
        from fastdeploy_r3.distributed.parallel_state import free_init_method
        from fastdeploy_r3.spawn import spawn_context, start_process
        from fastdeploy_r3.worker.worker_process import worker_main

        self._also_check = also_check
        self._stuck: set[int] = set()  # ranks that missed a deadline: stop() kills them outright
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        world = config.parallel_config.tensor_parallel_size
        dist_init_method = free_init_method()  # the ranks' TP group rendezvous
        for rank in range(world):
            parent, child = spawn_context().Pipe()
            args = (config, rank, world, engine_suffix, child, dist_init_method, runner_cls)
            self._procs.append(start_process(worker_main, args, name=f"fdr3-worker{rank}"))
            child.close()  # so that a dead worker reads as EOF here
            self._conns.append(parent)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]  # type: ignore[misc]

    def broadcast(self, msg: object) -> None:
        if isinstance(msg, PerRank) and len(msg.messages) != len(self._conns):
            raise ValueError(f"{len(msg.messages)} messages for {len(self._conns)} ranks")
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(msg.messages[rank] if isinstance(msg, PerRank) else msg)
            except OSError as e:
                raise self._gone(rank) from e

    def collect(self, timeout: float | None = None, while_waiting: Callable[[], None] | None = None) -> list[Any]:
        """One answer per rank, in rank order. `while_waiting` runs every poll (a control call's heartbeat)."""
        return [self._recv(rank, timeout, while_waiting) for rank in range(len(self._conns))]

    def call(self, msg: object, timeout: float | None = None,
             while_waiting: Callable[[], None] | None = None) -> list[Any]:
        self.broadcast(msg)
        return self.collect(timeout, while_waiting)

    def check_alive(self) -> None:
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                raise EngineDeadError(f"worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")

    def _recv(self, rank: int, timeout: float | None, while_waiting: Callable[[], None] | None = None) -> Any:
        conn = self._conns[rank]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not conn.poll(0.05):
            self.check_alive()
            self._also_check()
            if while_waiting is not None:
                while_waiting()
            if deadline is not None and time.monotonic() > deadline:
                self._stuck.add(rank)
                raise EngineDeadError(
                    f"worker rank {rank} (pid {self._procs[rank].pid}) did not answer within {timeout:g} s "
                    "(stuck or stopped); raise worker_step_timeout_s if its steps are legitimately this slow"
                )
        try:
            msg = conn.recv()
        except (EOFError, OSError) as e:
            raise self._gone(rank) from e
        if isinstance(msg, WorkerFailed):  # a rank that failed to start says why, then exits
            raise EngineDeadError(msg.describe())
        return msg

    def _gone(self, rank: int) -> EngineDeadError:
        proc = self._procs[rank]
        proc.join(timeout=1.0)
        return EngineDeadError(f"worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")

    def stop(self) -> None:
        """Ask politely, then terminate, then kill (a rank that missed a deadline: kill at once); idempotent."""
        for rank, proc in enumerate(self._procs):
            if rank in self._stuck and proc.is_alive():
                proc.kill()
        for proc, conn in zip(self._procs, self._conns):
            try:
                if proc.is_alive():
                    conn.send(Shutdown())
            except Exception:
                pass
        for proc, conn in zip(self._procs, self._conns):
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
            conn.close()
        self._procs, self._conns, self._stuck = [], [], set()
