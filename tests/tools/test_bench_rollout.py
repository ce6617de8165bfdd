"""The rollout benchmark stays runnable on the CPU: a tiny RL-shaped batch through a real server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fake_model import make_fake_model

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_rollout_bench_streams_every_sample_and_writes_table_json_and_png(tmp_path: Path) -> None:
    """2 prompts x 2 samples, outputs fixed at 6 tokens with ignore_eos: 24 output tokens, none failed."""
    model = tmp_path / "model"
    make_fake_model("qwen3_moe", str(model))
    out = tmp_path / "out"
    cmd = [sys.executable, "tools/bench_rollout.py", "--model", str(model), "--prompts", "2", "--n", "2",
           "--prompt-len", "8:24", "--max-tokens", "6", "--output-len", "fixed", "--ignore-eos",
           "--temperature", "0", "--out", str(out), "--png", str(out / "rollout.png")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "| run | samples | failed | wall s | output tokens |" in proc.stdout
    (res,) = json.loads((out / "rollout.json").read_text())
    assert res["label"] == "R3 on" and res["failed"] == 0 and res["output_tokens"] == 24
    # the engine's step counters (/metrics) moved: a mean step time and its parts
    assert res["step_ms"] > 0
    assert "engine step, R3 on: schedule " in proc.stdout and " send " in proc.stdout
    assert (out / "rollout.png").stat().st_size > 0
