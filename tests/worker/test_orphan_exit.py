"""A child whose parent died exits even when its main thread never runs the SIGTERM handler (stuck in
native I/O; here: SIGTERM ignored and the main thread asleep): the orphan watch runs the cleanup
and ends the process."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

from fastdeploy_r3.lifecycle import exit_when_orphaned


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited orphan waits for its new parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _stuck_child(marker: str, pid_file: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # what a read retried in native code amounts to
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    exit_when_orphaned(os.getppid(), lambda: open(marker, "w").close(), grace_s=0.5, poll_s=0.1)
    time.sleep(600)


def _parent(marker: str, pid_file: str) -> None:
    child = mp.get_context("fork").Process(target=_stuck_child, args=(marker, pid_file))
    child.start()
    while not os.path.exists(pid_file) or not open(pid_file).read():
        time.sleep(0.01)
    os._exit(0)  # the parent dies without stopping its child


def test_an_orphan_stuck_past_sigterm_cleans_up_and_exits(tmp_path) -> None:
    marker, pid_file = str(tmp_path / "cleaned"), str(tmp_path / "pid")
    parent = mp.get_context("fork").Process(target=_parent, args=(marker, pid_file))
    parent.start()
    parent.join(30)
    child_pid = int(open(pid_file).read())
    deadline = time.monotonic() + 30
    while _running(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child_pid) and os.path.exists(marker)
