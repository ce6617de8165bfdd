"""A child dies with its parent whatever it is doing; a server's IPC directory does not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from fastdeploy_r3.lifecycle import new_ipc_dir, pid_alive, remove_stale_ipc_dirs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return not pid_alive(pid)


def test_a_child_blocked_forever_exits_when_its_parent_is_sigkilled(tmp_path):
    """The child sleeps in a blocking call with SIGTERM unwinding into its cleanup; SIGKILL its parent."""
    marker = tmp_path / "cleaned"
    child = textwrap.dedent(f"""
        import os, signal, sys, time
        from fastdeploy_r3.lifecycle import exit_with_parent
        def on_term(signum, frame):
            raise SystemExit(0)
        signal.signal(signal.SIGTERM, on_term)
        try:
            exit_with_parent(int(sys.argv[1]))
            print(os.getpid(), flush=True)
            time.sleep(600)
        finally:
            open({str(marker)!r}, "w").write("yes")
    """)
    parent = textwrap.dedent("""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", sys.argv[1], str(__import__("os").getpid())])
        time.sleep(600)
    """)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    proc = subprocess.Popen([sys.executable, "-c", parent, child], stdout=subprocess.PIPE, text=True, env=env)
    try:
        child_pid = int(proc.stdout.readline())
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert _wait_gone(child_pid, 5.0)
        assert marker.read_text() == "yes"  # it ran its cleanup, it was not simply killed
    finally:
        proc.kill()
        proc.wait()


def test_a_child_whose_parent_died_before_it_asked_exits_at_once():
    code = "import os; from fastdeploy_r3.lifecycle import exit_with_parent; exit_with_parent(os.getppid() + 1)"
    out = subprocess.run([sys.executable, "-c", code + "; print('still here')"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO_ROOT), timeout=60)
    assert out.returncode == -signal.SIGTERM
    assert "still here" not in out.stdout


def test_ipc_dirs_of_gone_servers_are_swept_and_live_ones_kept(tmp_path):
    dead_pid = 2**22 + 4321  # above the default pid_max: no such process
    stale = tmp_path / f"fdr3_ipc_p{dead_pid}-abc123"
    stale.mkdir()
    (stale / "input").write_text("")
    live = tmp_path / f"fdr3_ipc_p{os.getpid()}-def456"
    live.mkdir()
    other = tmp_path / "fdr3_ipc_notapid"
    other.mkdir()
    older_style = tmp_path / "fdr3_ipc_9_b3dwa6"  # mkdtemp("fdr3_ipc_") of older servers: not ours to judge
    older_style.mkdir()
    assert remove_stale_ipc_dirs(str(tmp_path)) == [str(stale)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, older_style.name])


def test_a_new_ipc_dir_is_private_and_named_after_this_process():
    path = new_ipc_dir()
    try:
        assert os.path.basename(path).startswith(f"fdr3_ipc_p{os.getpid()}-")
        assert os.stat(path).st_mode & 0o777 == 0o700
    finally:
        os.rmdir(path)


def test_a_named_process_shows_its_name_in_proc():
    code = "from fastdeploy_r3.lifecycle import name_this_process as n; n('fdr3-worker12345'); " \
           "print(open('/proc/self/comm').read().strip())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO_ROOT), timeout=60)
    assert out.stdout.strip() == "fdr3-worker1234"  # cut to the kernel's 15 bytes


def test_the_cleanup_runs_once_when_the_sigterm_lands_before_it_starts(monkeypatch):
    """The parent-death SIGTERM's SystemExit lands in the cleanup's first line (after the child left its
    loop on the parent's EOF, before the cleanup ignored SIGTERM): the cleanup still runs, once, and the
    exit goes on. Before run_then_clean_up, a plain finally lost the whole cleanup this way."""
    from fastdeploy_r3 import lifecycle

    calls: list[str] = []
    first = [True]
    real = lifecycle.cleanup_begins

    def sigterm_lands_once() -> None:
        if first[0]:
            first[0] = False
            raise SystemExit(128 + signal.SIGTERM)
        real()

    monkeypatch.setattr(lifecycle, "cleanup_begins", sigterm_lands_once)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        try:
            lifecycle.run_then_clean_up(lambda: calls.append("body"), lambda: calls.append("cleanup"))
        except SystemExit as e:
            assert e.code == 128 + signal.SIGTERM
        else:
            raise AssertionError("the SystemExit must go on after the cleanup")
        assert calls == ["body", "cleanup"]
        calls.clear()
        with_error = [RuntimeError("step failed")]

        def failing_body() -> None:
            raise with_error[0]

        try:
            lifecycle.run_then_clean_up(failing_body, lambda: calls.append("cleanup"))
        except RuntimeError as e:
            assert e is with_error[0]
        assert calls == ["cleanup"]
    finally:
        signal.signal(signal.SIGTERM, previous)
