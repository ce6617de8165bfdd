"""Every message between the engine process and its worker processes (pickled over a pipe).

    engine -> worker   AttachRoutingBuffer, StepInput (of ScheduledRequestData), Shutdown;
                       between steps InitWeightUpdateGroup, UpdateWeights, DestroyWeightUpdateGroup,
                       ReleaseMemory, ResumeMemory, ChecksumWeights, ExpertDistribution, RebalanceExperts
    worker -> engine   WorkerReady (or WorkerFailed: the error that stopped the rank), RoutingAttached,
                       StepOutput, WeightUpdateResult, MemoryResult, WeightsChecksum, ExpertDistributionResult,
                       ExpertRebalanceResult
    a failed step      StepOutput.error: a WorkerError (kind + message), never a string to re-parse

`Shutdown` is the one stop message of every boundary (fastdeploy_r3/lifecycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdeploy_r3.cache_manager.routing_buffer import RoutingBufferSpec
from fastdeploy_r3.cache_manager.transfer import KVCacheSpec
from fastdeploy_r3.lifecycle import Shutdown
from fastdeploy_r3.logprobs import TokenLogprob
from fastdeploy_r3.sampling_params import SamplingParams

__all__ = [
    "PLACEHOLDER_TOKEN", "AttachRoutingBuffer", "ChecksumWeights", "DestroyWeightUpdateGroup", "ExpertDistribution",
    "ExpertDistributionResult", "ExpertRebalanceResult", "InitWeightUpdateGroup", "RebalanceExperts", "MemoryResult",
    "ReleaseMemory", "ResumeMemory", "RoutingAttached", "ScheduledRequestData", "Shutdown", "StepInput",
    "StepOutput", "UpdateWeights", "WeightUpdateResult", "WeightsChecksum", "WorkerError", "WorkerFailed",
    "WorkerReady",
]


@dataclass
class WorkerReady:
    rank: int
    num_gpu_blocks: int
    kv_spec: KVCacheSpec
    # positions past a sampling chunk that one step may feed (drafts it verifies): the engine reserves
    # their KV slots and R3 rows with the chunk; 0 while a step appends one token per request
    num_lookahead_tokens: int = 0


@dataclass(frozen=True)
class WorkerError:
    """An exception raised by a step on a worker rank. `kind` is its type name (what the engine tells
    the user a request failed of), `message` its text (for the engine log)."""

    kind: str
    message: str

    @classmethod
    def of(cls, e: BaseException) -> WorkerError:
        return cls(type(e).__name__, str(e))

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclass
class WorkerFailed:
    """The rank stopped on an error outside a step (start-up, attaching the routing buffer); it exits."""

    rank: int
    error: WorkerError
    traceback: str = ""

    def describe(self) -> str:
        return f"worker rank {self.rank} failed to start: {self.error.message}\n{self.traceback}"


@dataclass
class AttachRoutingBuffer:
    spec: RoutingBufferSpec | None


@dataclass
class RoutingAttached:
    """The rank attached the routing buffer (rank 0 writes R3 into it) and captured its decode graphs."""

    rank: int


# a token id the engine does not know yet: the one the worker sampled for the request in its previous
# step (a step scheduled ahead, engine/overlap.py); the worker substitutes it on the device
PLACEHOLDER_TOKEN = -1


@dataclass
class ScheduledRequestData:
    """One request's share of a step: feed token_ids at positions [start_pos, start_pos + len). A chunk
    scheduled ahead is [PLACEHOLDER_TOKEN]: the token this request sampled in the worker's previous step."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    # the request's block ids from index blocks_from on, and their routing tags: the whole table when
    # blocks_from is 0, else only the blocks appended since the worker last heard (worker/batch_state.py)
    block_table: list[int]
    block_tags: list[int]
    sample: bool  # this chunk reaches the last token: the step samples the request's next token(s)
    # when sample: how many of the chunk's last positions sample, each the token after it (1; a verify
    # step's drafts and the position before them: len(drafts) + 1)
    num_sample_rows: int = 1
    blocks_from: int = 0
    sampling_params: SamplingParams | None = None  # sent the first time the worker sees the request
    sampling_seed: int | None = None
    # also on the first time only, for what needs more than the chunk (StepSampler): the whole prompt
    # when penalties or prompt logprobs are asked for, and the ids min_tokens holds back (EOS unless
    # ignore_eos, plus stop_token_ids) when min_tokens > 0
    num_prompt_tokens: int = 0
    prompt_token_ids: list[int] | None = None
    min_tokens_stop_ids: list[int] | None = None


@dataclass
class StepInput:
    step_id: int
    requests: list[ScheduledRequestData]
    finished_request_ids: list[str] = field(default_factory=list)


@dataclass
class StepOutput:
    """Per request that sampled, its new tokens in order (one or more: a step that verifies drafts
    returns the accepted ones and a bonus token, every one but the last fed in this step)."""

    step_id: int
    sampled_token_ids: dict[str, list[int]]
    error: WorkerError | None = None
    # per request that asked: one logprob record per sampled token; and prompt logprobs of the chunk's
    # positions as (position of the first entry, entries), entry j scoring prompt token first + j
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    launched_ahead: bool = False  # launched while the step before it was unfinished (worker_process.py)
    # MTP speculative decoding (worker/mtp_drafter.py): per request that sampled, up to k drafts to follow
    # its last sampled token, for the engine to feed next step
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class InitWeightUpdateGroup:
    """Join a trainer's group as rank rank_offset + tp_rank (SGLang's /init_weights_update_group)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


@dataclass
class DestroyWeightUpdateGroup:
    group_name: str


@dataclass
class UpdateWeights:
    """New weights, from exactly one source: a checkpoint directory, a trainer's broadcast over a
    group (names/dtypes/shapes announced, in broadcast order), or full tensors in the message."""

    model_path: str | None = None
    group_name: str | None = None
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    tensors: list[tuple[str, object]] | None = None  # (HF name, torch.Tensor) for offline LLM.update_weights
    # SGLang's /update_weights_from_tensor: one MultiprocessingSerializer payload per TP rank (base64 text
    # or bytes of a pickle whose tensors travel as CUDA IPC handles / shared-memory files, never their data)
    serialized_named_tensors: list[str | bytes] | None = None
    load_format: str | None = None  # None | "direct" | "flattened_bucket" (SGLang's names)


@dataclass
class WeightUpdateResult:
    rank: int
    error: str | None = None
    weights_changed: bool = False  # error after some parameters took new values
    num_tensors: int = 0


MEMORY_TAGS = ("kv_cache", "weights")


@dataclass
class ReleaseMemory:
    """Free the memory of `tags` (SGLang's /release_memory_occupation); their contents are gone."""

    tags: list[str]


@dataclass
class ResumeMemory:
    """Allocate the memory of `tags` again; a resumed KV cache is empty, resumed weights hold no values
    until a weight update fills them."""

    tags: list[str]


@dataclass
class MemoryResult:
    rank: int
    error: str | None = None
    nbytes: int = 0  # bytes freed (release) or allocated (resume) on this rank
    # torch.cuda.memory_allocated of this rank's device around the call (0 on the CPU)
    allocated_before: int = 0
    allocated_after: int = 0


@dataclass
class ChecksumWeights:
    """SHA-256 of every parameter this rank holds (/weights_checker)."""


@dataclass
class WeightsChecksum:
    rank: int
    checksums: dict[str, str] = field(default_factory=dict)  # parameter name -> sha256 hex of its bytes
    error: str | None = None


EXPERT_DISTRIBUTION_ACTIONS = ("start", "stop", "dump")


@dataclass
class ExpertDistribution:
    """Expert load recording (model_executor/layers/expert_load.py): "start" (reset, count), "stop", "dump"."""

    action: str


@dataclass
class ExpertDistributionResult:
    rank: int
    counts: list[list[int]] | None = None  # dump: [L][E] rows routed to each logical expert of each MoE layer
    recording: bool = False  # whether the rank counts after this action
    error: str | None = None


@dataclass
class RebalanceExperts:
    """Take the slots of this placement (one map for every MoE layer), weights exchanged between the ranks
    (model_executor/layers/expert_rebalance.py). Every rank gets it: the moves are collectives."""

    physical_to_logical: tuple[int, ...]


@dataclass
class ExpertRebalanceResult:
    rank: int
    bytes_received: int = 0
    error: str | None = None
