"""The tables, plot and R3 on / off ratios tools/bench_rollout.py prints from its runs."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from bench_rollout import RunResult


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def row(r: RunResult) -> str:
    ok = [s for s in r.samples if s.error is None]
    ttft = [1e3 * s.ttft for s in ok if s.ttft is not None]
    tpot = [1e3 * s.tpot for s in ok if s.tpot is not None]
    step = f"{r.step_ms:.2f}" if r.step_ms is not None else "n/a"
    return (f"| {r.label} | {len(r.samples)} | {len(r.samples) - len(ok)} | {r.wall_s:.1f} | {r.output_tokens} | "
            f"{r.tok_s:.0f} | {_pct(ttft, 50):.0f} | {_pct(ttft, 99):.0f} | {_pct(tpot, 50):.2f} | "
            f"{_pct(tpot, 99):.2f} | {step} |")


HEADER = ("| run | samples | failed | wall s | output tokens | output tok/s | TTFT p50 ms | TTFT p99 ms | "
          "TPOT p50 ms | TPOT p99 ms | engine step ms |\n"
          "| --- | ------- | ------ | ------ | ------------- | ------------ | ----------- | ----------- | "
          "----------- | ----------- | -------------- |")


def plot(results: list[RunResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for r in results:
        t = np.array([p[0] for p in r.timeline])
        toks = np.array([p[1] for p in r.timeline], dtype=float)
        w = min(4, len(t) - 1)  # a one-second window over the 0.25 s samples
        if w < 1:
            continue
        rate = (toks[w:] - toks[:-w]) / np.maximum(t[w:] - t[:-w], 1e-9)
        ax1.plot(t[w:], rate, label=r.label)
        ax2.plot(t, [p[2] for p in r.timeline], label=r.label)
    ax1.set_ylabel("output tok/s")
    ax2.set_ylabel("requests in flight")
    ax2.set_xlabel("seconds since the rollout started")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def r3_ratios(results: list[RunResult]) -> dict[str, list[float]]:
    """R3 on / off output tok/s of each pair (--r3 both), by concurrency ("" without a sweep)."""
    by: dict[str, dict[str, list[float]]] = {}
    for r in results:
        m = re.match(r"(?:concurrency (\d+), )?R3 (on|off) #\d+$", r.label)
        if m:
            by.setdefault(m.group(1) or "", {"on": [], "off": []})[m.group(2)].append(r.tok_s)
    return {c: [a / b for a, b in zip(v["on"], v["off"])] for c, v in by.items()}
