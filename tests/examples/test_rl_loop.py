"""examples/rl_loop.py end to end on the CPU with the tiny GLM-4.5 (a dense layer 0): rollouts with R3
through /generate, the trainer's replayed forward reproduces them, weights pushed over gloo twice, and
the next rollouts carry the new version and follow the new weights."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from api_server_process import REPO_ROOT, server_env


def test_rl_loop_runs_two_weight_updates(fake_model_dir) -> None:
    cmd = [sys.executable, os.path.join(REPO_ROOT, "examples", "rl_loop.py"), "--model", fake_model_dir("glm4_moe"),
           "--steps", "2", "--max-new-tokens", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=server_env(), cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and proc.stdout.rstrip().endswith("rl_loop: OK")
    for i, line in enumerate(steps):
        assert f"step {i}: weight_version {i} (ok)" in line and "replayed greedy tokens equal" in line, line
    changed = [int(m) for m in re.findall(r"R3 rows changed since last step (\d+)", proc.stdout)]
    assert len(changed) == 2 and all(n > 0 for n in changed)  # the pushed weights route differently
