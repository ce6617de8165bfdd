"""A request as the engine sees it: prompt, sampled tokens and a few integer cursors.

    tokens:  [ prompt (P) ............ | output (N) ...... ]
             ^0                        ^P                  ^num_tokens
    computed (KV written, R3 rows written):  [0, num_computed_tokens)

Chunked prefill, prefix hits, preemption and resumption are all "num_computed_tokens catches up
to num_tokens - 1 (the last token is only fed when the next one is sampled)".
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from fastdeploy_r3.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # admitted, its blocks held while a cache tier loads its prefix into them
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


@dataclass(frozen=True)
class WeightVersionEvent:
    """A weight update reached a request in flight: `version` had sampled its first num_output_tokens
    tokens and computed KV (and R3 rows) for its first num_computed_tokens."""

    version: str
    num_output_tokens: int
    num_computed_tokens: int


@dataclass
class Request:
    """The scheduler's view of one sequence: its tokens and cursors. What the caller is owed of it
    (text, deltas sent, logprobs, R3, how it ended) is the TokenProcessor's (token_processor.OutputState)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission, -1 until admitted
    num_preemptions: int = 0
    # prompt logprobs asked for and some prompt position not scored yet: its KV must be computed, so
    # admission takes no prefix hit (cleared by the TokenProcessor once every position is scored)
    needs_prompt_logprobs: bool = False
    # weight versions: the one computing this request now, and the updates it lived through
    weight_version: str = ""
    weight_version_events: list[WeightVersionEvent] = field(default_factory=list)
    # speculative decoding (engine/speculative.py): sampling steps, drafts fed, drafts accepted
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        self.needs_prompt_logprobs = self.sampling_params.prompt_logprobs is not None and len(self.prompt_token_ids) > 1

    @property
    def spans_weight_versions(self) -> bool:
        """Some of its tokens, KV or R3 rows come from weights other than the current ones."""
        return any(e.num_output_tokens or e.num_computed_tokens for e in self.weight_version_events)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished
