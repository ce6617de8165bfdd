"""The CacheTransferManager's process: its entry point, the loop that runs the engine's tasks, and how
it ends (cache_transfer_manager.py does the copies).

Tasks run one at a time in submission order, except PD2GPU: a prefill server writing a room into the
GPU tier (pd_receive.py) waits on the network, so those run on threads of their own and ack when done.
That is safe because a PD2GPU task writes only blocks the engine holds for the loading request alone
(uncached, never the target of another task until its ack), and the engine matches acks by task id. A
PD thread whose transfer's end is unknown hands PeerWriteUnknown to the loop, which exits with it
before it sends another ack.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

from fastdeploy_r3.cache_manager.cache_transfer_manager import CacheTransferManager
from fastdeploy_r3.cache_manager.pd_receive import PeerWriteUnknown
from fastdeploy_r3.cache_manager.shm import pid_alive, unlink_all, unlink_quietly
from fastdeploy_r3.cache_manager.transfer import CacheTransferConfig, CTMReady, TransferKind, TransferTask
from fastdeploy_r3.lifecycle import (
    Shutdown,
    exit_after,
    exit_when_orphaned,
    exit_with_parent,
    freeze_startup_heap,
    name_this_process,
    parent_gone,
    run_then_clean_up,
    unwind_on_sigterm,
)

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 0.5
_PD_THREADS = 4  # rooms received at once

_EOF = object()


def _reader(conn: Connection, inbox: queue.Queue) -> None:
    # Drain the pipe in its own thread so that the engine's submit() never blocks on a busy CTM, and a
    # closed pipe (engine gone) is noticed even in the middle of a long task.
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        inbox.put(_EOF)


def run_cache_transfer_manager(config: CacheTransferConfig, conn: Connection) -> None:
    """Entry point of the CTM subprocess: set up, say ready, run tasks FIFO until told or orphaned."""
    logging.basicConfig(level=logging.INFO, format="[CTM %(process)d] %(levelname)s %(message)s")

    signal.signal(signal.SIGTERM, unwind_on_sigterm)  # unwinds into clean_up below, which unlinks the CPU tier
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the engine stops us
    ppid = os.getppid()  # reparenting means the process that started us died, even if parent_pid lives
    state = _CtmState()

    def clean_up() -> None:
        _unlink(config, engine_gone=not state.told_to_stop and _engine_died(ppid, config.parent_pid))
        if state.manager is not None:
            state.manager.close()

    # then leave without the finalization of a frozen heap (lifecycle.freeze_startup_heap)
    exit_after(lambda: run_then_clean_up(lambda: _serve(config, conn, ppid, state), clean_up))


@dataclasses.dataclass
class _CtmState:
    manager: CacheTransferManager | None = None
    told_to_stop: bool = False
    pd_threads: ThreadPoolExecutor | None = None


def _engine_died(ppid: int, engine_pid: int, wait_s: float = 1.0) -> bool:
    """Whether the engine is gone. The kernel closes a dying engine's pipes (our EOF) a moment before it
    reparents us, so give that moment; an engine that is alive and stopping us never shows as gone."""
    deadline = time.monotonic() + wait_s
    while not (parent_gone(ppid) or not pid_alive(engine_pid)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _serve(config: CacheTransferConfig, conn: Connection, ppid: int, state: _CtmState) -> None:
    """Set up, say ready, run tasks FIFO until told or orphaned (PD transfers on threads beside them);
    `state` tells the cleanup what to close."""
    try:
        exit_with_parent(ppid)  # SIGTERM the moment the engine dies, even in the middle of a task
        # and a CTM stuck in native I/O (a hung storage read) that never runs the handler exits anyway
        exit_when_orphaned(ppid, lambda: _unlink(config, engine_gone=True))
        name_this_process("fdr3-ctm")
        try:
            state.manager = manager = CacheTransferManager(config)
        except Exception as e:
            logger.exception("CTM setup failed")
            conn.send(CTMReady(os.getpid(), error=f"{type(e).__name__}: {e}"))
            return
        conn.send(CTMReady(os.getpid()))
        freeze_startup_heap()
        if config.pd_receiver:
            threading.Thread(target=_ready_pd, args=(manager,), daemon=True, name="ctm-pd-ready").start()
        inbox: queue.Queue = queue.Queue()
        replies = _Replies(conn)
        threading.Thread(target=_reader, args=(conn, inbox), daemon=True, name="ctm-reader").start()
        while True:
            try:
                item = inbox.get(timeout=_PARENT_POLL_S)
            except queue.Empty:
                if not pid_alive(config.parent_pid) or os.getppid() != ppid:
                    logger.warning("engine (pid %d) is gone; CTM exits", config.parent_pid)
                    return
                continue
            if isinstance(item, Shutdown):
                state.told_to_stop = True
                return
            if item is _EOF:
                return
            if isinstance(item, PeerWriteUnknown):  # from a PD thread: exit before any other ack
                raise item
            if item.kind is TransferKind.PD2GPU:  # waits on the network: beside the FIFO, not in it
                state.pd_threads = state.pd_threads or ThreadPoolExecutor(_PD_THREADS, thread_name_prefix="ctm-pd")
                state.pd_threads.submit(_run_pd, manager, item, replies, inbox)
                continue
            replies.send(manager.run_task(item))
    except (BrokenPipeError, EOFError):
        return
    finally:
        if state.pd_threads is not None:  # their transfers end within their timeouts
            state.pd_threads.shutdown(wait=True, cancel_futures=True)


def _ready_pd(manager: CacheTransferManager) -> None:
    """A PD decode server's CTM: its transfer engine and HTTP client before the first transfer needs them (a
    failure here is the first transfer's to report, as a failed load)."""
    try:
        logger.info("ready for prefill servers' writes at %s", manager.pd_receiver().segment)
    except Exception as e:  # noqa: BLE001 - the first PD2GPU task tries again and fails its load clearly
        logger.warning("could not ready the transfer engine for prefill servers' writes: %s", e)


def _run_pd(manager: CacheTransferManager, task: TransferTask, replies: _Replies, inbox: queue.Queue) -> None:
    try:
        replies.send(manager.run_task(task))
    except PeerWriteUnknown as e:
        inbox.put(e)
    except (BrokenPipeError, EOFError, OSError):
        pass  # the engine is gone; the main loop sees it too


class _Replies:
    """conn.send for the main loop and the PD threads, one message at a time."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self._lock = conn, threading.Lock()

    def send(self, msg: object) -> None:
        with self._lock:
            self.conn.send(msg)


def _unlink(config: CacheTransferConfig, engine_gone: bool) -> None:
    """Unlink the CTM's own segments by name (that covers what a failed setup left half made) and, when
    the engine died, every segment of the engine as well: the workers do the same, and either child
    doing it is enough, so that one child killed outright (SIGKILL, the OOM killer) leaves nothing."""
    for name in config.segment_names():
        unlink_quietly(name)
    if engine_gone and config.engine_suffix:
        unlink_all(config.engine_suffix)


