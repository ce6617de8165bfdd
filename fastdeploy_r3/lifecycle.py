"""Process life-cycle: the words every process boundary shares, and how the processes of one server
die together and leave nothing behind.

`Shutdown` is the one "finish what you hold and exit" message; `EngineDeadError` the one error for
"the engine, or a child it needs, is gone" (raised in the engine when a worker dies, and in the API
server when the engine process does).

    api_server ──► engine ──► worker rank 0..TP-1
                          └─► cache transfer manager

Each child asks the kernel to send it SIGTERM the moment its parent dies (`exit_with_parent`), so
that it exits whatever it is doing, even blocked in a send or in the middle of a step; its SIGTERM
handler unwinds into the cleanup that unlinks its shared memory. A SIGKILLed process cleans nothing
itself, so what it owns is named after it: SHM segments carry the engine's pid (cache_manager/shm.py)
and the ZMQ IPC directory the API server's (`new_ipc_dir`), and the next start sweeps names whose
owner is gone (`remove_stale_ipc_dirs`, `shm.remove_stale_segments`).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# fdr3_ipc_p<pid>-<random>: mkdtemp's random part never holds "-", so no other name reads as one of these
IPC_DIR_PREFIX = "fdr3_ipc_p"
_IPC_DIR_RE = re.compile(rf"^{IPC_DIR_PREFIX}(\d+)-")


def exit_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux; elsewhere a no-op).

    Call it first thing in the child. The parent may already be gone by then (the signal is only
    armed for a death that comes later), so that case sends the signal at once.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    except (OSError, AttributeError):  # not Linux: the children's own parent polling still applies
        return
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def unwind_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM handler of the children: unwind once (SystemExit) into their cleanup, and ignore any
    SIGTERM after that, so that a second one (the kernel may deliver the parent-death signal more than
    once) does not cut the cleanup short and leave shared memory behind. SIGKILL still ends a stuck one."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def cleanup_begins() -> None:
    """Call first in a child's final cleanup: a SIGTERM now (the parent-death signal arriving after
    the child already saw its parent's pipe close) must not unwind out of the cleanup it would start."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def run_then_clean_up(body: Callable[[], None], cleanup: Callable[[], None]) -> None:
    """body(), then cleanup() exactly once, however body ends: returning, raising, or unwinding on SIGTERM.

    A plain try/finally is not enough for a child whose parent dies: the kernel closes the parent's
    pipes before it sends the parent-death signal, so the child sees EOF, leaves its loop, and the
    SIGTERM's SystemExit can land between the loop's last statement and the finally's first, skipping
    the whole cleanup (a CI run lost a SIGKILLed engine's shared memory that way; the story test is in
    tests/engine/test_supervision.py). The outer handler catches that one SystemExit and cleans up; no
    second one can come, since unwind_on_sigterm ignores SIGTERM from its first delivery on."""
    done = False

    def clean() -> None:
        nonlocal done
        cleanup_begins()
        if not done:
            done = True
            cleanup()

    try:
        try:
            body()
        finally:
            clean()
    except SystemExit:
        clean()
        raise


def name_this_process(name: str) -> None:
    """Set the name `ps`, `top` and /proc/PID/comm show (15 bytes at most), e.g. `fdr3-worker0`.

    Spawned children all run `python -c ...spawn_main...`; a name tells an operator, and the fault
    tests, which one is the engine, a worker or the cache transfer manager.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def freeze_startup_heap() -> None:
    """Call once a process has started (imports done, model loaded): what exists now moves to the
    collector's permanent generation. Full collections while serving no longer walk torch's,
    transformers' and the model's objects, and neither does the interpreter when the process exits (a
    process that imported torch otherwise spends about a second of CPU just leaving)."""
    gc.collect()
    gc.freeze()


def exit_without_finalizing(code: int) -> NoReturn:
    """End a child whose cleanup is done, skipping the interpreter's finalization: with its heap frozen
    (freeze_startup_heap) the objects of native extensions are never collected, and nanobind's (Triton's)
    leak check would print pages of "leaked instance" at exit. Logs and std streams are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def exit_after(life: Callable[[], None]) -> NoReturn:
    """A child's whole life, then exit_without_finalizing with the code Python would have exited with: 0,
    a SystemExit's (the SIGTERM unwind: 143), or 1 after printing what escaped."""
    code = 0
    try:
        life()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported where it could be; printed here, as Python would
        traceback.print_exc()
        code = 1
    exit_without_finalizing(code)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def parent_gone(parent_pid: int) -> bool:
    """Whether the process that started this one has exited (we were reparented, or its pid is gone)."""
    return os.getppid() != parent_pid or not pid_alive(parent_pid)


def new_ipc_dir() -> str:
    """A private (0700) directory for this server's ZMQ sockets, named after this process."""
    return tempfile.mkdtemp(prefix=f"{IPC_DIR_PREFIX}{os.getpid()}-")


def remove_stale_ipc_dirs(root: str | None = None) -> list[str]:
    """Remove the IPC directories of servers whose process is gone; returns their paths."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        m = _IPC_DIR_RE.match(name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(root, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


@dataclass
class Shutdown:
    """Sent to a child process: release what you hold (shared memory, process groups) and exit."""


class EngineDeadError(RuntimeError):
    """The engine or one of its child processes died; in-flight requests were failed. Restart it."""


def exit_when_orphaned(parent_pid: int, cleanup: Callable[[], None], grace_s: float = 5.0,
                       poll_s: float = 0.5) -> threading.Thread:
    """Backstop of `exit_with_parent` for a child whose main thread cannot take the SIGTERM: stuck in a
    read that native code retries (a FIFO, a hung network file), Python's handler never runs. A daemon
    thread sees the parent gone, gives the normal unwind `grace_s`, then runs `cleanup` (unlinking by
    name is harmless twice) and ends the process with os._exit."""

    def watch() -> None:
        while not parent_gone(parent_pid):
            time.sleep(poll_s)
        time.sleep(grace_s)  # the SIGTERM unwind usually finishes (and exits) within this
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - exiting matters more than a clean log here
            logger.exception("cleanup of an orphaned process failed")
        finally:
            os._exit(1)

    thread = threading.Thread(target=watch, name="fdr3-orphan-watch", daemon=True)
    thread.start()
    return thread
