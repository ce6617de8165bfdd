"""What a request returns to its caller: one RequestOutput per user request, one CompletionOutput
per choice (as vLLM keeps them at the package top). Both the API server and the offline `LLM` build
these from the engine's per-step deltas with one assembler (see `OutputAssembler`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    routed_experts: np.ndarray | None = None  # [rows, L, K]
    routed_experts_start: int = 0
    error: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    moe_layer_ids: list[int] | None = None
    num_cached_tokens: int = 0
