"""The short profile of tools/soak.py: a mixed load with a CTM kill, a Redis stop, a rollout race on
the shared store, a full storage directory and a worker kill (the server exits and is restarted);
every request ends clearly."""

from __future__ import annotations

import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def row(table: str, name: str) -> str:
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] == name:
            return cells[1]
    raise AssertionError(f"no row {name!r} in:\n{table}")


def test_short_soak_has_no_hang_no_wrong_row_and_no_leak() -> None:
    cmd = [sys.executable, os.path.join(REPO_ROOT, "tools", "soak.py"), "--requests", "70", "--concurrency", "6",
           "--fault-every", "3", "--min-faults", "5",
           "--faults", "ctm-kill,redis-stop,rollout-race,storage-full,worker-kill", "--stop-seconds", "2",
           "--step-timeout", "20", "--stall-timeout", "30", "--hang-after", "90"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=REPO_ROOT,
                         env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    table = out.stdout
    assert out.returncode == 0, f"{table}\n{out.stderr[-3000:]}"
    assert int(row(table, "requests")) >= 70
    for name in ("hung", "wrong R3 rows", "unclear errors", "leaked processes", "leaked /dev/shm segments",
                 "leaked IPC directories"):
        assert row(table, name) == "0", table
    assert int(row(table, "served, R3 exact")) > 0
    for fault in ("ctm-kill", "redis-stop", "rollout-race", "storage-full", "worker-kill"):
        assert fault in row(table, "faults injected"), table
