"""The soak's table: every request's outcome, the faults, the leaks, and what the hung ones followed."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from soak_load import OUTCOMES
from soak_load import Stats as RequestStats


@dataclass
class Stats(RequestStats):
    faults: Counter = field(default_factory=Counter)
    restarts: int = 0
    leaked_processes: int = 0
    leaked_segments: int = 0
    leaked_ipc_dirs: int = 0
    leak_examples: list[str] = field(default_factory=list)
    rss: list[tuple[float, float]] = field(default_factory=list)  # (seconds, MiB of the whole server tree)
    fault_log: list[tuple[float, str]] = field(default_factory=list)  # (monotonic time, fault) as injected
    hung_sent: list[tuple[float, str]] = field(default_factory=list)  # (monotonic time sent, kind) of hung ones

    def hung_by_fault(self) -> str:
        """Each hung request by the fault injected last before it was sent (or while it waited)."""
        by: Counter = Counter()
        for sent, kind in self.hung_sent:
            near = [name for t, name in self.fault_log if t <= sent + 1.0]
            by[f"{near[-1] if near else 'no fault yet'} ({kind})"] += 1
        return ", ".join(f"{k} {v}" for k, v in by.most_common())


def table(stats: Stats, seconds: float) -> str:
    lat = sorted(stats.latencies)
    pct = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000) if lat else (lambda q: float("nan"))
    total = sum(stats.outcomes.values())
    rows = [("requests", total)]
    for name in OUTCOMES:
        rows.append((name, stats.outcomes.get(name, 0)))
    rows += [("leaked processes", stats.leaked_processes), ("leaked /dev/shm segments", stats.leaked_segments),
             ("leaked IPC directories", stats.leaked_ipc_dirs),
             ("faults injected", ", ".join(f"{k} {v}" for k, v in sorted(stats.faults.items())) or "none"),
             ("server restarts", stats.restarts),
             ("latency p50 / p99 (served)", f"{pct(0.5):.0f} / {pct(0.99):.0f} ms"),
             ("wall time", f"{seconds:.0f} s")]
    if stats.rss:
        step = max(1, len(stats.rss) // 8)
        rows.append(("RSS of the server tree", ", ".join(f"{t:.0f}s {m:.0f}MiB" for t, m in stats.rss[::step])))
    width = max(len(r[0]) for r in rows)
    lines = [f"| {'what'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
    for k, v in stats.examples.items():
        lines.append(f"first '{k}': {v}")
    if stats.hung_sent:
        lines.append(f"hung, by the fault before them: {stats.hung_by_fault()}")
    lines += [f"leak: {x}" for x in stats.leak_examples[:5]]
    return "\n".join(lines)
