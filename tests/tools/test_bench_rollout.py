"""The rollout benchmark stays runnable on the CPU: a tiny RL-shaped batch through a real server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fake_model import make_fake_model

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_rollout_bench_streams_every_sample_and_writes_table_json_and_png(tmp_path: Path) -> None:
    """2 prompts x 2 samples, outputs fixed at 6 tokens with ignore_eos: 24 output tokens, none failed,
    sent by two client processes (their samples' times merged back into one table and plot)."""
    model = tmp_path / "model"
    make_fake_model("qwen3_moe", str(model))
    out = tmp_path / "out"
    cmd = [sys.executable, "tools/bench_rollout.py", "--model", str(model), "--prompts", "2", "--n", "2",
           "--prompt-len", "8:24", "--max-tokens", "6", "--output-len", "fixed", "--ignore-eos",
           "--temperature", "0", "--client-procs", "2", "--return-logprob",
           "--out", str(out), "--png", str(out / "rollout.png")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "| run | samples | failed | wall s | output tokens |" in proc.stdout
    (res,) = json.loads((out / "rollout.json").read_text())
    assert res["label"] == "R3 on" and res["failed"] == 0 and res["output_tokens"] == 24
    # the engine's step counters (/metrics) moved: a mean step time and its parts
    assert res["step_ms"] > 0
    assert "engine step, R3 on: schedule " in proc.stdout and " send " in proc.stdout
    assert (out / "rollout.png").stat().st_size > 0
    assert "host CPU, R3 on: client " in proc.stdout and "API server " in proc.stdout


def test_rollout_bench_reports_what_a_speculative_server_drafted_and_kept(tmp_path: Path) -> None:
    """A server started with n-gram speculation (its flag passed through --server-arg): the samples all
    finish with their 16 tokens, and the run reports the drafts its steps fed and how many were accepted."""
    model = tmp_path / "model"
    make_fake_model("qwen3_moe", str(model))
    out = tmp_path / "out"
    spec = '--speculative-config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    cmd = [sys.executable, "tools/bench_rollout.py", "--model", str(model), "--prompts", "2", "--n", "2",
           "--prompt-len", "8:24", "--max-tokens", "16", "--output-len", "fixed", "--ignore-eos",
           "--temperature", "0", f"--server-arg={spec}", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (res,) = json.loads((out / "rollout.json").read_text())
    assert res["failed"] == 0 and res["output_tokens"] == 64, res
    drafts, accepted = res["spec"]["draft_tokens"], res["spec"]["accepted_tokens"]
    assert drafts > 0 and 0 <= accepted <= drafts and res["spec"]["verify_steps"] > 0, res["spec"]
    assert f"speculation, R3 on: {drafts:.0f} drafts fed in " in proc.stdout, proc.stdout[-1500:]


def test_r3_ratios_pair_each_on_run_with_the_off_run_before_it_per_concurrency() -> None:
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from bench_rollout import RunResult, Sample
    from rollout_report import r3_ratios

    def run(label: str, tok_s: float) -> RunResult:  # tok_s output tokens in one second
        return RunResult(label, 1.0, [Sample([1], int(tok_s), tokens=int(tok_s))], None, [])

    results = [run("warm-up", 1.0), run("concurrency 64, R3 off #1", 100.0), run("concurrency 256, R3 off #1", 400.0),
               run("concurrency 64, R3 on #1", 99.0), run("concurrency 256, R3 on #1", 392.0),
               run("concurrency 64, R3 off #2", 110.0), run("concurrency 256, R3 off #2", 400.0),
               run("concurrency 64, R3 on #2", 110.0), run("concurrency 256, R3 on #2", 404.0)]
    assert r3_ratios(results) == {"64": [0.99, 1.0], "256": [0.98, 1.01]}
    assert r3_ratios([run("R3 off #1", 10.0), run("R3 on #1", 9.0)]) == {"": [0.9]}
