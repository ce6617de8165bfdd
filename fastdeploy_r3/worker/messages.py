"""Every message between the engine process and its worker processes (pickled over a pipe).

    engine -> worker   AttachRoutingBuffer, StepInput (of ScheduledRequestData), Shutdown
    worker -> engine   WorkerReady (or the exception that stopped start-up), StepOutput

`Shutdown` is the one stop message of every boundary (fastdeploy_r3/lifecycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdeploy_r3.cache_manager.routing_buffer import RoutingBufferSpec
from fastdeploy_r3.cache_manager.transfer import KVCacheSpec
from fastdeploy_r3.lifecycle import Shutdown
from fastdeploy_r3.sampling_params import SamplingParams

__all__ = ["AttachRoutingBuffer", "ScheduledRequestData", "Shutdown", "StepInput", "StepOutput", "WorkerReady"]


@dataclass
class WorkerReady:
    rank: int
    num_gpu_blocks: int
    kv_spec: KVCacheSpec


@dataclass
class AttachRoutingBuffer:
    spec: RoutingBufferSpec | None


@dataclass
class ScheduledRequestData:
    """One request's share of a step: feed token_ids at positions [start_pos, start_pos + len)."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    block_tags: list[int]  # routing_tag of each block in block_table
    sample: bool  # this chunk reaches the last token: sample the next one
    sampling_params: SamplingParams | None = None  # sent the first time the worker sees the request
    sampling_seed: int | None = None


@dataclass
class StepInput:
    step_id: int
    requests: list[ScheduledRequestData]
    finished_request_ids: list[str] = field(default_factory=list)


@dataclass
class StepOutput:
    step_id: int
    sampled_token_ids: dict[str, int]
    error: str | None = None
