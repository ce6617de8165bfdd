"""The engine benchmark stays runnable on the CPU with the fake tiny model (CI keeps it alive this way)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_engine_bench_runs_on_cpu_and_writes_table_json_and_png(tmp_path: Path) -> None:
    """batch 1 and 2, 4 decode steps (2 R3 on, 2 off), 1 prefill prompt: a row per batch with the roofline
    inputs, the profile table and a PNG."""
    out = tmp_path / "out"
    cmd = [sys.executable, "tools/bench_r3.py", "--device", "cpu", "--batches", "1,2", "--prompt-len", "8",
           "--decode-steps", "4", "--prefill-prompts", "1", "--prefill-len", "16", "--profile-batch", "2",
           "--out", str(out), "--png", str(out / "bench.png")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "| batch | step ms | roofline ms |" in proc.stdout and "prefill:" in proc.stdout
    res = json.loads((out / "bench.json").read_text())
    assert [r["batch"] for r in res["rows"]] == [1, 2]
    row = res["rows"][0]
    assert row["bytes"]["experts_touched_per_layer"] == 4.0  # one token, top-4 of the tiny model
    assert row["roofline_ms"] > 0 and row["step_ms"] > 0
    assert (out / "profile_bs2.txt").stat().st_size > 0 and (out / "bench.png").stat().st_size > 0
