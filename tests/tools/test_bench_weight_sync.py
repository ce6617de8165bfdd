"""The weight-sync benchmark stays runnable on the CPU with the fake tiny model: every operation gets a
time, the distributed push runs over gloo, the server serves the pushed weights, and the PNG is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_weight_sync_bench_runs_on_cpu(tmp_path: Path) -> None:
    png, out = tmp_path / "sync.png", tmp_path / "sync.json"
    cmd = [sys.executable, "tools/bench_weight_sync.py", "--device", "cpu", "--repeats", "1", "--bucket-mb", "1",
           "--num-gpu-blocks", "32", "--max-model-len", "128", "--png", str(png), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "| operation | seconds | GB/s | note |" in proc.stdout
    res = json.loads(out.read_text())
    ops = [r["op"] for r in res["rows"]]
    assert ops == ["update_weights_from_tensor (direct)", "update_weights_from_tensor (flattened_bucket)",
                   "update_weights_from_distributed (gloo)", "release_memory_occupation",
                   "resume_memory_occupation", "update_weights_from_tensor (flattened_bucket) after resume"]
    assert all(r["seconds"] > 0 for r in res["rows"]) and res["weight_bytes"] > 0
    assert png.stat().st_size > 0
