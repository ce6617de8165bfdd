"""Every message between the API server and the engine process (the ZMQ boundary), pickled (a step's
outputs packed into flat arrays first: engine/output_wire.py).

    api_server -> engine   AddRequest, AbortRequest, MetricsQuery, HealthQuery, ControlRequest, Shutdown
    engine -> api_server   EngineReady | EngineStartupFailed, then OutputBatch, RequestRejected,
                           MetricsReply, HealthReply, ControlReply, EngineCrashed

ControlRequest carries one RL control command (engine/control.py runs it between two steps): pause,
continue, flush, a weight update, joining or leaving a trainer's weight update group, or a state query.

The other boundaries keep theirs in one module each: engine <-> worker in worker/messages.py,
engine <-> cache transfer manager in cache_manager/transfer.py. `Shutdown` is the one stop message
of every boundary (fastdeploy_r3/lifecycle.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from fastdeploy_r3.cache_manager.transfer import RemoteBlocks
from fastdeploy_r3.engine.output_wire import PackedDeltas, pack_deltas, unpack_deltas
from fastdeploy_r3.lifecycle import Shutdown
from fastdeploy_r3.outputs import RequestDelta
from fastdeploy_r3.sampling_params import SamplingParams
from fastdeploy_r3.worker.messages import DestroyWeightUpdateGroup, InitWeightUpdateGroup, UpdateWeights

__all__ = [
    "AbortRequest", "AddRequest", "AwaitWriteThrough", "ContinueGeneration", "ControlCommand", "ControlReply",
    "ControlRequest", "EngineCrashed", "EngineInfo", "ErrorKind", "EngineReady", "EngineStartupFailed", "EngineState",
    "EngineStateQuery", "ExpertDistributionRecord", "ExpertLoadReport",
    "ExpertPlacementReport", "ExpertRebalance", "FlushCache", "HealthQuery", "HealthReply",
    "MetricsQuery", "MetricsReply", "OutputBatch",
    "PauseGeneration", "ReleaseMemoryOccupation", "RequestRejected", "ResumeMemoryOccupation", "Shutdown",
    "UpdateWeightVersion", "MemoryReport", "WeightUpdate", "WeightUpdateSession", "WeightsCheck", "WeightsReport",
]


# -- API server -> engine --------------------------------------------------------------------------


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    # refused unless the engine holds exactly this version when the request arrives: PD's decode server
    # runs a prompt its prefill server computed (entrypoints/pd/roles.py); rows of two versions never mix
    weight_version: str | None = None
    # PD: the prefill server's room that writes the prompt's full blocks into this engine's (pd_receive.py)
    remote_blocks: RemoteBlocks | None = None
    # PD, the prompt's partial last block (cache_manager/prompt_tails.py): a prefill server's request stores it
    # as it ends; a decode server's, continuing a prompt of peer_prompt_tokens, loads it with the full ones
    keep_prompt_tail: bool = False
    peer_prompt_tokens: int = 0


@dataclass
class AbortRequest:
    request_id: str
    message: str | None = None  # why, as the request's finish message says


@dataclass
class MetricsQuery:
    query_id: int


@dataclass
class HealthQuery:
    query_id: int


@dataclass
class PauseGeneration:
    mode: str  # "abort" | "in_place" | "retract"


@dataclass
class ContinueGeneration:
    pass


@dataclass
class FlushCache:
    pass


@dataclass
class AwaitWriteThrough:
    """Answer once every block write-through submitted so far is stored (or failed): a prefill server
    hands a request over only when its blocks are in the shared store (entrypoints/pd/roles.py)."""


@dataclass
class EngineStateQuery:
    pass


@dataclass
class CheckIntegrity:
    """Check the KV cache manager's books (free list, ref counts, hash map, block owners): GET
    /check_integrity, which fault tests ask the surviving server after killing its peer."""


@dataclass
class WeightUpdate:
    source: UpdateWeights
    weight_version: str | None
    abort_all_requests: bool
    force: bool = False  # reload even when weight_version is the current one (else: 200, nothing reloaded)


@dataclass
class UpdateWeightVersion:
    """Name the weights in place (SGLang's /update_weight_version): a new version roots every cache."""

    new_version: str
    abort_all_requests: bool = False


@dataclass
class ReleaseMemoryOccupation:
    tags: list[str]  # of worker/messages.py MEMORY_TAGS


@dataclass
class ResumeMemoryOccupation:
    tags: list[str]


@dataclass
class WeightsCheck:
    """/weights_checker: "checksum" | "snapshot" (remember the checksums) | "compare" (against the snapshot)."""

    action: str
    skip: list[str] = field(default_factory=list)  # parameter names left out of the comparison


@dataclass
class WeightUpdateSession:
    """/begin_weight_update (begin=True) and /end_weight_update."""

    begin: bool


@dataclass
class ExpertDistributionRecord:
    """SGLang's /start_expert_distribution_record, /stop_... and /dump_...: action "start" | "stop" | "dump"."""

    action: str


@dataclass
class ExpertRebalance:
    """/rebalance_experts: a placement from the recorded expert load, weights moved between the ranks."""


ControlCommand = (
    PauseGeneration | ContinueGeneration | FlushCache | EngineStateQuery | WeightUpdate | AwaitWriteThrough
    | CheckIntegrity | InitWeightUpdateGroup | DestroyWeightUpdateGroup | UpdateWeightVersion | ReleaseMemoryOccupation
    | ResumeMemoryOccupation | WeightsCheck | WeightUpdateSession | ExpertDistributionRecord
    | ExpertRebalance
)


@dataclass
class ControlRequest:
    """An RL control command, run between two engine steps; answered by a ControlReply."""

    query_id: int
    command: ControlCommand


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
    """One engine step's deltas, for every request that advanced, packed (engine/output_wire.py);
    `OutputBatch.of(deltas)` packs, `.unpack()` gives the outputs.RequestDelta list back."""

    packed: PackedDeltas

    @classmethod
    def of(cls, deltas: list[RequestDelta]) -> OutputBatch:
        return cls(pack_deltas(deltas))

    def unpack(self) -> list[RequestDelta]:
        return unpack_deltas(self.packed)


class ErrorKind(enum.Enum):
    """Why the engine refused a request, as the API server answers it; the message says it in words."""

    INVALID = "invalid"  # the request itself was wrong (HTTP 400)
    OVERLOADED = "overloaded"  # the waiting queue is full: retry later (HTTP 429)
    FAILED = "failed"  # the engine failed taking it (HTTP 500)
    UNAVAILABLE = "unavailable"  # the engine cannot serve now (weights broken, memory released): HTTP 503
    WEIGHT_VERSION = "weight_version"  # the request named other weights than the engine holds (PD: HTTP 502)


@dataclass
class RequestRejected:
    """add_request raised: the request never entered the engine."""

    request_id: str
    message: str
    kind: ErrorKind


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
class EngineState:
    weight_version: str
    paused: str | None  # the pause mode, None while generating
    num_requests: int  # user requests in flight (held ones included)


@dataclass
class WeightsReport:
    """What /weights_checker found: SHA-256 per parameter per TP rank, and one digest of them all."""

    checksums: list[dict[str, str]]  # per rank: parameter name -> sha256 hex of its bytes
    engine_checksum: str  # sha256 over every rank's sorted (name, digest) pairs
    mismatched: list[str] = field(default_factory=list)  # "compare": parameters that differ from the snapshot


@dataclass
class MemoryReport:
    """What /release_memory_occupation and /resume_memory_occupation did, per TP rank."""

    nbytes: list[int]  # freed / allocated
    allocated_before: list[int]  # torch.cuda.memory_allocated around the call (0 on the CPU)
    allocated_after: list[int]


@dataclass
class ExpertLoadReport:
    """A dumped expert load record: rows routed to each LOGICAL expert of each MoE layer since the start."""

    logical_count: list[list[int]]  # [L][E]
    recording: bool  # whether the engine still counts


@dataclass
class ExpertPlacementReport:
    """What /rebalance_experts placed: the logical expert of each physical slot, P/N consecutive per rank."""

    physical_to_logical: list[int]


@dataclass
class IntegrityReport:
    """What /check_integrity found consistent: with no request in flight, no block may be referenced
    (a block still referenced then was reserved and never freed)."""

    num_requests: int
    num_referenced_blocks: int
    num_blocks: int


@dataclass
class ControlReply:
    query_id: int
    success: bool
    message: str
    state: EngineState
    invalid: bool = False  # a refused command (HTTP 400) rather than a failed one (HTTP 500)
    status: int | None = None  # an HTTP status other than 200/400/500 (409: conflicts with the engine's state)
    report: WeightsReport | MemoryReport | IntegrityReport | ExpertLoadReport | ExpertPlacementReport | None = None


@dataclass
class EngineCrashed:
    """The loop died; every in-flight request must fail with this message."""

    message: str
