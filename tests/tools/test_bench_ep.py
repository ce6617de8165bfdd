"""The expert-parallel layer benchmark stays runnable on the CPU (two gloo ranks): every stage of both
dispatches gets a time on each rank, the bytes are the all-reduce's for local and the all-to-all's counter
for alltoall, the two dispatches compute the same layer, and the PNG is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_ep_bench_runs_on_cpu_with_gloo(tmp_path: Path) -> None:
    png, out = tmp_path / "ep.png", tmp_path / "ep.json"
    cmd = [sys.executable, "tools/bench_ep.py", "--device", "cpu", "--ep", "2", "--hidden", "64", "--experts", "8",
           "--top-k", "2", "--inter", "32", "--tokens", "5", "12", "--warmup", "1", "--repeats", "1",
           "--bandwidth-gbs", "10",
           "--png", str(png), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "| backend | tokens | rank | dispatch ms | experts ms | combine ms | reduce ms |" in proc.stdout
    assert "| roofline ms | layer / roofline |" in proc.stdout
    res = json.loads(out.read_text())
    rows = {(r["backend"], r["tokens"], r["rank"]): r for r in res["rows"]}
    assert sorted(rows) == [(b, t, r) for b in ("alltoall", "local") for t in (5, 12) for r in (0, 1)]
    for (backend, tokens, _), r in rows.items():
        assert all(r[f"{s}_ms"] > 0 for s in ("dispatch", "experts", "combine", "reduce"))
        assert r["max_rel_diff"] < 1e-5
        # roofline: this rank's touched experts (w13 + w2: 3 x 32 x 64 float32 each; no shared experts) plus
        # what it sends, over the 10 GB/s given
        assert 1 <= r["touched_experts"] <= 4 and r["weight_bytes"] == r["touched_experts"] * 3 * 32 * 64 * 4
        assert r["roofline_bytes"] == r["weight_bytes"] + r["bytes_sent"]
        assert abs(r["roofline_ms"] - r["roofline_bytes"] / 10e9 * 1e3) < 1e-12
        if backend == "local":  # a two-rank ring all-reduce of [T, 64] float32: each rank sends T x 64 x 4
            assert r["bytes_sent"] == tokens * 64 * 4
        else:  # at least this rank's gathered chunk of ceil(T / 2) tokens and the row counts
            assert r["bytes_sent"] >= -(-tokens // 2) * 64 * 4 + 8
    assert png.stat().st_size > 0
