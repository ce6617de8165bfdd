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

import numpy as np

from fastdeploy_r3.engine.detokenizer import IncrementalDetokenizer
from fastdeploy_r3.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
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


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission, -1 until admitted
    num_preemptions: int = 0
    # text/stop handling and deltas (TokenProcessor): text decoded but not yet sent, held back while
    # a stop string could still begin in it; cursors of what the last delta carried
    detokenizer: IncrementalDetokenizer | None = None
    pending_text: str = ""
    num_sent_tokens: int = 0
    delta_finished: bool = False  # the delta carrying its finish went out
    num_returned_tokens: int | None = None  # N: output tokens returned to the user, set at finish
    stop_reason: str | int | None = None
    error: str | None = None
    routed_experts: np.ndarray | None = None

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
