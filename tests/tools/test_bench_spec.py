"""The speculative decoding benchmark stays runnable on the CPU with the fake tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tools"))

from bench_spec import expected_tokens  # noqa: E402


def test_expected_tokens_per_verify_step() -> None:
    assert expected_tokens(0.0, 3) == 1.0  # every draft rejected: the bonus token alone
    assert expected_tokens(1.0, 3) == 4.0  # every draft accepted: k + 1
    assert abs(expected_tokens(0.7, 3) - (1 + 0.7 + 0.49 + 0.343)) < 1e-12


def test_spec_bench_runs_on_cpu_and_writes_the_table(tmp_path: Path) -> None:
    """batch 1 and 2, k 1 and 2, 2 timed steps each: a plain row (with its pipelined step) and a row per k for
    each batch, each with its speedup against the pipelined plain step too; the profiler tables of batch 1's
    plain and k = 2 steps; the plot."""
    cmd = [sys.executable, "tools/bench_spec.py", "--device", "cpu", "--batches", "1,2", "--ks", "1,2", "--steps", "2",
           "--prompt-len", "8", "--profile-k", "2", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "| batch | k | step ms | cost x plain |" in proc.stdout
    res = json.loads((tmp_path / "bench_spec.json").read_text())
    assert [(r["batch"], r["k"]) for r in res["rows"]] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert sorted(p.name for p in tmp_path.glob("profile_*")) == ["profile_plain_bs1.txt", "profile_verify_k2_bs1.txt"]
    assert "aten::" in (tmp_path / "profile_verify_k2_bs1.txt").read_text()
    assert (tmp_path / "bench_spec.png").read_bytes()[:4] == b"\x89PNG"
    plain = {r["batch"]: r for r in res["rows"] if r["k"] == 0}
    for r in res["rows"]:
        assert r["step_ms"] > 0
        for a, tok_s in r["tok_s"].items():
            assert abs(tok_s - r["batch"] * expected_tokens(float(a), r["k"]) / (r["step_ms"] / 1e3)) < 1e-6 * tok_s
            # against the plain step the server pipelines when speculation is off
            piped_tok_s = r["batch"] / (plain[r["batch"]]["pipelined_ms"] / 1e3)
            assert abs(r["speedup_vs_pipelined"][a] - tok_s / piped_tok_s) < 1e-6 * tok_s / piped_tok_s
    assert all(p["pipelined_ms"] > 0 for p in plain.values())
    assert "x pipelined plain at a=0.7 |" in proc.stdout


def test_mtp_spec_bench_runs_on_cpu_with_the_fake_glm(tmp_path: Path) -> None:
    """--method mtp: a plain runner's decode rows, then an MTP runner's verify rows (its draft layer drafting)."""
    cmd = [sys.executable, "tools/bench_spec.py", "--device", "cpu", "--method", "mtp", "--batches", "1", "--ks", "2",
           "--steps", "1", "--prompt-len", "4", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads((tmp_path / "bench_spec.json").read_text())
    assert res["method"] == "mtp" and "MTP drafts" in res["title"]
    assert [(r["batch"], r["k"]) for r in res["rows"]] == [(1, 0), (1, 2)]
    assert res["rows"][0]["pipelined_ms"] > 0 and res["rows"][1]["speedup_vs_pipelined"]["0.7"] > 0


def test_quantization_fp8_reaches_the_runner_the_steps_are_timed_on(tmp_path: Path) -> None:
    """--quantization fp8: the runner that times the plain and verify steps holds float8 weights."""
    import argparse

    import torch
    from bench_spec import _step_bench
    from fake_model import make_fake_model

    args = argparse.Namespace(batches="1", ks="1", prompt_len=8, steps=1, device="cpu", dtype="float32",
                              enforce_eager=True, quantization="fp8", profile_k=None)  # fmt: skip
    sb = _step_bench(args, make_fake_model("qwen3_moe", str(tmp_path), preset="tiny"), "auto", None)
    try:
        dtypes = {p.dtype for p in sb.runner.model.parameters()} | {b.dtype for b in sb.runner.model.buffers()}
    finally:
        sb.close()
    assert torch.float8_e4m3fn in dtypes, dtypes
