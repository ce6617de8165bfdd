"""Every message between the API server and the engine process (the ZMQ boundary), pickled.

    api_server -> engine   AddRequest, AbortRequest, MetricsQuery, HealthQuery, Shutdown
    engine -> api_server   EngineReady | EngineStartupFailed, then OutputBatch, RequestRejected,
                           MetricsReply, HealthReply, EngineCrashed

The other boundaries keep theirs in one module each: engine <-> worker in worker/messages.py,
engine <-> cache transfer manager in cache_manager/transfer.py. `Shutdown` is the one stop message
of every boundary (fastdeploy_r3/lifecycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdeploy_r3.lifecycle import Shutdown
from fastdeploy_r3.outputs import RequestDelta
from fastdeploy_r3.sampling_params import SamplingParams

__all__ = [
    "AbortRequest", "AddRequest", "EngineCrashed", "EngineInfo", "EngineReady", "EngineStartupFailed",
    "HealthQuery", "HealthReply", "MetricsQuery", "MetricsReply", "OutputBatch", "RequestRejected", "Shutdown",
]


# -- API server -> engine --------------------------------------------------------------------------


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class MetricsQuery:
    query_id: int


@dataclass
class HealthQuery:
    query_id: int


# -- engine -> API server --------------------------------------------------------------------------


@dataclass
class EngineInfo:
    """What the API server needs to know about the engine it talks to."""

    pid: int
    max_model_len: int
    moe_layer_ids: list[int]
    num_experts: int
    moe_top_k: int
    routing_dtype: str | None
    enable_routing_replay: bool


@dataclass
class EngineReady:
    info: EngineInfo


@dataclass
class EngineStartupFailed:
    message: str
    traceback: str = ""


@dataclass
class OutputBatch:
    """One engine step's deltas, for every request that advanced (see outputs.RequestDelta)."""

    outputs: list[RequestDelta]


@dataclass
class RequestRejected:
    """add_request raised: the request never entered the engine."""

    request_id: str
    message: str
    invalid: bool  # True: the request was bad (HTTP 400); False: the engine failed (HTTP 500)


@dataclass
class MetricsReply:
    query_id: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class HealthReply:
    query_id: int
    ok: bool
    message: str = ""
    degraded: dict[str, str] = field(default_factory=dict)  # part -> why, e.g. {"kv_storage": "..."}


@dataclass
class EngineCrashed:
    """The loop died; every in-flight request must fail with this message."""

    message: str
