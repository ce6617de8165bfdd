"""Engine-side handle of the CacheTransferManager subprocess: start it, submit tasks, collect acks,
notice its death. The subprocess itself is in cache_transfer_manager.py, imported only when a CTM is
started (it brings torch); the messages and errors of the boundary are in transfer.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from fastdeploy_r3.cache_manager.shm import unlink_quietly
from fastdeploy_r3.cache_manager.transfer import (
    CacheTransferConfig,
    CacheTransferError,
    CacheTransferTimeout,
    CTMReady,
    TransferAck,
    TransferKind,
    TransferTask,
)
from fastdeploy_r3.lifecycle import Shutdown
from fastdeploy_r3.spawn import spawn_context, start_process

__all__ = ["CacheTransferClient", "CacheTransferError", "CacheTransferTimeout", "TransferStats"]


@dataclass
class TransferStats:
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    storage_put_blocks: int = 0
    storage_get_blocks: int = 0
    storage_miss_blocks: int = 0  # missing, corrupt or mismatched in storage
    bytes_moved: int = 0
    by_kind_bytes: dict[str, int] = field(default_factory=dict)
    store_counters: dict[str, int] = field(default_factory=dict)  # the storage tier's, as of the last storage ack


class CacheTransferClient:
    """Engine-side handle of the CTM subprocess. Not thread-safe: use it from one engine thread.

    Every ack is handed out exactly once, by `wait(task_id)` or by `poll()`.
    """

    def __init__(self) -> None:
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        self._config: CacheTransferConfig | None = None
        self._pending: dict[int, TransferTask] = {}
        self._arrived: dict[int, TransferAck] = {}
        self._ready = False
        self.stats = TransferStats()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self, config: CacheTransferConfig, timeout: float = 120.0) -> None:
        """Spawn the CTM and wait until its CPU tier exists and storage is reachable."""
        self.launch(config)
        if not self.ready(timeout):
            self.shutdown()
            raise CacheTransferError(f"cache transfer manager did not come up within {timeout} s")

    def launch(self, config: CacheTransferConfig) -> None:
        """Spawn the CTM without waiting for it; `ready()` says when it is up."""
        if self._proc is not None:
            raise CacheTransferError("CacheTransferClient.start() called twice; call shutdown() first")
        from fastdeploy_r3.cache_manager.ctm_process import run_cache_transfer_manager

        parent_conn, child_conn = spawn_context().Pipe(duplex=True)
        self._config = config
        self._proc = start_process(run_cache_transfer_manager, (config, child_conn), name="CacheTransferManager")
        child_conn.close()  # so that the CTM's death reads as EOF here
        self._conn = parent_conn
        self._ready = False

    def ready(self, timeout: float = 0.0) -> bool:
        """True once the launched CTM said it is ready (waits up to `timeout`); raises CacheTransferError
        (after cleaning up) when its setup failed or it died."""
        if self._ready:
            return True
        parent_conn = self._require_conn()
        if not parent_conn.poll(timeout):
            return False
        try:
            ready: CTMReady = parent_conn.recv()
        except EOFError:
            code = self._exit_code()
            self.shutdown()
            raise CacheTransferError(
                f"cache transfer manager exited with code {code} during setup; see its log"
            ) from None
        if ready.error is not None:
            self.shutdown()
            raise CacheTransferError(f"cache transfer manager setup failed: {ready.error}")
        self._ready = True
        return True

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def submit(self, task: TransferTask) -> None:
        if task.task_id in self._pending or task.task_id in self._arrived:
            raise ValueError(f"task_id {task.task_id} is already in flight; task ids must be unique")
        conn = self._require_conn()
        try:
            conn.send(task)
        except (BrokenPipeError, OSError):
            raise self._died() from None
        self._pending[task.task_id] = task

    def poll(self) -> list[TransferAck]:
        """Acks that have arrived and were not yet handed out (non-blocking).

        Raises CacheTransferError once the CTM is dead and nothing is left to hand out while tasks are pending.
        """
        alive = self._drain(timeout=0.0)
        if not alive and not self._arrived and self._pending:
            raise self._died()
        acks = list(self._arrived.values())
        self._arrived.clear()
        return acks

    def wait(self, task_id: int, timeout: float | None = 60) -> TransferAck:
        """Block until the ack of `task_id` arrives; raise promptly if the CTM dies, or after `timeout`."""
        if task_id not in self._pending and task_id not in self._arrived:
            raise ValueError(f"task {task_id} was never submitted or its ack was already handed out")
        deadline = None if timeout is None else time.monotonic() + timeout
        while task_id not in self._arrived:
            left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if left <= 0:
                raise CacheTransferTimeout(f"no ack for task {task_id} within {timeout} s; the CTM is alive but busy")
            if not self._drain(timeout=left) and task_id not in self._arrived:
                raise self._died()
        return self._arrived.pop(task_id)

    def wait_any(self, timeout: float) -> bool:
        """Block until some ack is there to hand out (True) or `timeout` passed (False): an engine with
        nothing to run but transfers in flight waits on the pipe, not in a sleep. Raises
        CacheTransferError once the CTM is dead while tasks are pending."""
        if self._arrived:
            return True
        if not self._drain(timeout) and not self._arrived and self._pending:
            raise self._died()
        return bool(self._arrived)

    def _drain(self, timeout: float) -> bool:
        """Read every ack that is there (waiting up to `timeout` for the first); False if the CTM is gone."""
        conn = self._require_conn()
        try:
            while conn.poll(timeout):
                self._record(conn.recv())
                timeout = 0.0
        except (EOFError, OSError):
            return False
        return self._proc.is_alive()

    def _record(self, ack: TransferAck) -> None:
        task = self._pending.pop(ack.task_id)
        n_ok = len(task.gpu_block_ids) - len(ack.failed)
        s = self.stats
        if ack.kind == TransferKind.SWAP2CPU:
            s.swap_out_blocks += n_ok
        elif ack.kind == TransferKind.SWAP2GPU:
            s.swap_in_blocks += n_ok
        elif ack.kind == TransferKind.GPU2STORAGE:
            s.storage_put_blocks += n_ok
        else:
            s.storage_get_blocks += n_ok
            s.storage_miss_blocks += len(ack.failed)
        if ack.store_counters:
            s.store_counters = dict(ack.store_counters)
        s.bytes_moved += ack.nbytes
        s.by_kind_bytes[ack.kind.value] = s.by_kind_bytes.get(ack.kind.value, 0) + ack.nbytes
        self._arrived[ack.task_id] = ack

    def _exit_code(self) -> int | None:
        assert self._proc is not None
        self._proc.join(timeout=1.0)
        return self._proc.exitcode

    def _died(self) -> CacheTransferError:
        code = self._exit_code()
        lost = sorted(self._pending)
        return CacheTransferError(
            f"cache transfer manager (pid {self.pid}) exited with code {code}; tasks {lost} are lost (their "
            "blocks count as misses; see the CTM log for the cause)"
        )

    def _require_conn(self) -> Connection:
        if self._conn is None or self._proc is None:
            raise CacheTransferError("cache transfer manager is not started; call start(config) first")
        return self._conn

    def kill(self) -> None:
        """SIGKILL a CTM that is stuck or stopped (it cannot be asked), then clean up as shutdown() does.

        After this returns the process is gone, so nothing it was doing can still write a GPU block."""
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)
        self.shutdown(timeout=1.0)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the CTM (politely, then SIGTERM, then SIGKILL) and make sure its SHM is gone."""
        proc, conn = self._proc, self._conn
        if proc is not None:
            if proc.is_alive() and conn is not None:
                try:
                    conn.send(Shutdown())
                except (BrokenPipeError, OSError):
                    pass
                proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout)
        if conn is not None:
            conn.close()
        if self._config is not None:
            for name in self._config.segment_names():
                unlink_quietly(name)
        self._proc = self._conn = None
        self._pending.clear()
