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


@dataclass
class CompletionDelta:
    """One choice's progress in one engine step: only what is new since its previous delta."""

    index: int
    text: str  # new text (complete characters only)
    token_ids: list[int]  # new token ids
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    routed_experts: np.ndarray | None = None  # [rows, L, K], on the finishing delta only
    routed_experts_start: int = 0
    error: str | None = None


@dataclass
class RequestDelta:
    """What the engine sends per step for one user request (the engine -> server wire carries these)."""

    request_id: str
    outputs: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int = 0
    # on the request's first delta only: the prompt is not re-sent every step
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    moe_layer_ids: list[int] | None = None


class OutputAssembler:
    """Builds one request's RequestOutput from its deltas (the server and `LLM` share this)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self.moe_layer_ids: list[int] | None = None
        self.num_cached_tokens = 0
        self.finished = False
        self._texts: dict[int, list[str]] = {}
        self._token_ids: dict[int, list[int]] = {}
        self._last: dict[int, CompletionDelta] = {}

    def add(self, delta: RequestDelta) -> None:
        if delta.request_id != self.request_id:
            raise ValueError(f"delta of {delta.request_id!r} given to the assembler of {self.request_id!r}")
        if delta.prompt_token_ids is not None:
            self.prompt, self.prompt_token_ids = delta.prompt, list(delta.prompt_token_ids)
            self.moe_layer_ids = delta.moe_layer_ids
        self.num_cached_tokens = delta.num_cached_tokens
        self.finished = delta.finished
        for c in delta.outputs:
            self._texts.setdefault(c.index, []).append(c.text)
            self._token_ids.setdefault(c.index, []).extend(c.token_ids)
            self._last[c.index] = c

    def output(self) -> RequestOutput:
        """The cumulative output so far (joins the text: call it once per request, not per step)."""
        comps = [
            CompletionOutput(
                index=i,
                text="".join(self._texts[i]),
                token_ids=list(self._token_ids[i]),
                finish_reason=last.finish_reason,
                stop_reason=last.stop_reason,
                routed_experts=last.routed_experts,
                routed_experts_start=last.routed_experts_start,
                error=last.error,
            )
            for i, last in sorted(self._last.items())
        ]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=comps,
            finished=self.finished,
            moe_layer_ids=self.moe_layer_ids,
            num_cached_tokens=self.num_cached_tokens,
        )
