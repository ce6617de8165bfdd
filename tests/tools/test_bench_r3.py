"""The engine benchmark stays runnable on the CPU with the fake tiny model (CI keeps it alive this way), and
its pipelined decode (StepBench.decode_pipelined: launched ahead, requests sent as diffs, placeholders fed
on the device) samples what the synchronous decode samples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from step_bench import StepBench

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
    assert "| step / roofline | pipelined step ms | pipelined / roofline |" in proc.stdout
    res = json.loads((out / "bench.json").read_text())
    assert [r["batch"] for r in res["rows"]] == [1, 2]
    row = res["rows"][0]
    assert row["bytes"]["experts_touched_per_layer"] == 4.0  # one token, top-4 of the tiny model
    assert row["roofline_ms"] > 0 and row["step_ms"] > 0
    assert all(r["pipelined_ms"] > 0 and r["pipelined_ratio"] > 0 for r in res["rows"])
    assert (out / "profile_bs2.txt").stat().st_size > 0 and (out / "bench.png").stat().st_size > 0


def _decode_tokens(sb: StepBench, since: int) -> dict[str, list[int]]:
    """Every request's tokens sampled by the steps from index `since` of sb.sampled on, in order."""
    out: dict[str, list[int]] = {}
    for step in sb.sampled[since:]:
        for rid, toks in step.items():
            out.setdefault(rid, []).extend(toks)
    return out


def test_pipelined_decode_samples_the_synchronous_decodes_greedy_tokens(fake_model_dir) -> None:  # noqa: ANN001
    """From the same prefill: n synchronous steps, n pipelined ones (placeholders fed from the previous
    step's draw, no block diffs) and a mix (pipelined, then synchronous, then pipelined again: the state
    each leaves behind is what the next reads) sample the same ids and write the same R3 rows."""
    sb = StepBench(fake_model_dir("qwen3_moe"), "cpu", "float32", "auto", 4, 64, 64, 4, 256, True)
    n = 8
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 500, k).tolist() for k in (9, 13, 6)]  # positions end mid-block and on one

    def run(steps) -> tuple[dict[str, list[int]], np.ndarray, list]:  # noqa: ANN001
        sb.routing_host.rows[:] = 0
        sb.prefill(prompts, reserve=n)
        since = len(sb.sampled)
        steps()
        return _decode_tokens(sb, since), sb.routing_host.rows.copy(), list(sb.requests)

    try:
        want, want_rows, want_requests = run(lambda: sb.decode([True] * n))
        got, got_rows, got_requests = run(lambda: sb.decode_pipelined(n))
        assert sorted(want) == ["r0", "r1", "r2"] and all(len(t) == n for t in want.values()), want
        assert len({tuple(t) for t in want.values()}) == 3  # the requests differ: a mixed-up feed would show
        assert got == want
        assert np.array_equal(got_rows, want_rows) and (want_rows != 0).any()
        assert got_requests == want_requests  # positions advanced by n
        mixed, mixed_rows, _ = run(lambda: (sb.decode_pipelined(3), sb.decode([True] * 2), sb.decode_pipelined(n - 5)))
        assert mixed == want and np.array_equal(mixed_rows, want_rows)
        assert sb.last_tokens == {rid: toks[-1] for rid, toks in want.items()}
        assert len(sb.decode_pipelined(0)) == 0
    finally:
        sb.close()
