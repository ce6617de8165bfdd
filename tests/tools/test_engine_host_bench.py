"""The engine host-work benchmark stays runnable on the CPU: a speculative engine's steps with a stand-in
device time, sent early and not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# tools/ on the spawned worker's path too: it imports the runner by its module name
PATH = os.pathsep.join(str(p) for p in (REPO_ROOT, REPO_ROOT / "tools", REPO_ROOT / "tests"))


def test_speculative_steps_with_a_device_stand_in_report_the_exposed_host_time() -> None:
    """batch 2, k = 3, 10 steps of 3 ms each way: every line has the wall time, the engine's host work
    and the time beyond the 3 ms the device would take; the steps took the 3 ms at least."""
    lines = {}
    for flag in ([], ["--no-send-early"]):
        cmd = [sys.executable, "tools/engine_host_bench.py", "--batch", "2", "--steps", "10", "--speculative", "3",
               "--gpu-ms", "3", *flag]  # fmt: skip
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
                              env={**os.environ, "PYTHONPATH": PATH})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        lines[bool(flag)] = [ln for ln in proc.stdout.splitlines() if ln.startswith("batch")]
    for late, found in lines.items():
        assert len(found) == 1 and "exposed beyond --gpu-ms" in found[0], (late, found)
        wall = float(found[0].split(":")[1].split("ms/step wall")[0])
        exposed = float(found[0].split(", ")[-1].split(" ms/step exposed")[0])
        assert wall >= 3.0 and abs(wall - 3.0 - exposed) < 0.011, found[0]

