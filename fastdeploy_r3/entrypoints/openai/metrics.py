"""Prometheus text for /metrics: the engine's counters (swap, prefix cache, R3 gather) and the API
server's R3 delivery counters, read fresh on each scrape.

    fastdeploy_r3_engine_<name>[_total]    from EngineService.metrics()
    fastdeploy_r3_server_<name>[_total]    ServerCounters
    fastdeploy_r3_engine_alive             0 once the engine process is gone
"""

from __future__ import annotations

import dataclasses
import re

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fastdeploy_r3.entrypoints.openai.serving_engine import ServerCounters

# Engine values that go up and down (block pool sizes, queue lengths) are named num_*; every other
# engine value is a monotonic counter.
_GAUGE_RE = re.compile(r"^num_")


def _metric_name(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


class _Snapshot:
    def __init__(self, engine_metrics: dict[str, float] | None, counters: ServerCounters) -> None:
        self.engine_metrics = engine_metrics
        self.counters = counters

    def collect(self):
        alive = GaugeMetricFamily("fastdeploy_r3_engine_alive", "1 while the engine process answers")
        alive.add_metric([], 0.0 if self.engine_metrics is None else 1.0)
        yield alive
        for name, value in sorted((self.engine_metrics or {}).items()):
            full = f"fastdeploy_r3_engine_{_metric_name(name)}"
            if _GAUGE_RE.search(name):
                yield GaugeMetricFamily(full, f"engine {name}", value=float(value))
            else:
                yield CounterMetricFamily(full.removesuffix("_total"), f"engine {name}", value=float(value))
        for f in dataclasses.fields(self.counters):
            value = float(getattr(self.counters, f.name))
            yield CounterMetricFamily(f"fastdeploy_r3_server_{f.name}", f"API server {f.name}", value=value)


def render_metrics(engine_metrics: dict[str, float] | None, counters: ServerCounters) -> tuple[bytes, str]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(engine_metrics, counters))
    return generate_latest(registry), CONTENT_TYPE_LATEST
