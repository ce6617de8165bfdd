"""What a request returns to its caller: one RequestOutput per user request, one CompletionOutput
per choice (as vLLM keeps them at the package top). Both the API server and the offline `LLM` build
these from the engine's per-step deltas with one assembler (see `OutputAssembler`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from fastdeploy_r3.logprobs import PromptLogprobs, TokenLogprob


@dataclass(frozen=True)
class WeightVersionSpan:
    """Output tokens [start, end) were sampled by weights `version` (SGLang's meta_info weight_versions)."""

    version: str
    start: int
    end: int


def weight_version_spans(
    updates: list[tuple[str, int]], current: str, num_output_tokens: int
) -> list[WeightVersionSpan]:
    """The versions that sampled a request's output tokens, in order; one span when no update reached it.

    updates: per weight update the request lived through, (the old version, how many output tokens
    the request had then); current: the version computing it now.
    """
    spans: list[WeightVersionSpan] = []
    for version, end in [*updates, (current, num_output_tokens)]:
        end = min(end, num_output_tokens)
        start = spans[-1].end if spans else 0
        if spans and end <= start:
            continue
        if spans and spans[-1].version == version:
            spans[-1] = WeightVersionSpan(version, spans[-1].start, end)
        elif spans and spans[-1].start == spans[-1].end:
            spans[-1] = WeightVersionSpan(version, start, end)  # a version that sampled nothing
        else:
            spans.append(WeightVersionSpan(version, start, end))
    return spans


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
    logprobs: list[TokenLogprob] | None = None  # one per token id, when SamplingParams.logprobs is set
    finish_message: str | None = None  # why an aborted choice stopped, in words
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)
    spans_weight_versions: bool = False  # tokens/R3 of more than one weight version (an in-place update)
    spec: SpecDecodeStats | None = None  # speculative decoding served it


@dataclass(frozen=True)
class SpecDecodeStats:
    """A finished choice's speculative decoding (engine/speculative.py), SGLang's meta_info fields."""

    verify_ct: int  # sampling steps, each a verify of 0..k drafts
    draft_tokens: int
    accepted_tokens: int


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    moe_layer_ids: list[int] | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs is set


class TextRule(enum.IntEnum):
    """Who turns a delta's token ids into text. The engine detokenizes only requests with stop strings
    (it must see their text to stop them); the others' deltas leave it to the receiver, which replays
    exactly what the engine would have done, token by token (engine/detokenizer.py DeltaDetokenizer):

        IN_TEXT               `text` holds it (the engine detokenized)
        PUSH                  push each token id; the request goes on
        PUSH_FLUSH            push each, then flush what was held back (finished at its length)
        PUSH_BUT_LAST_FLUSH   push all but the last, then flush: the last is a stop token whose text is
                              trimmed (it stays in token_ids), as vLLM does
    """

    IN_TEXT = 0
    PUSH = 1
    PUSH_FLUSH = 2
    PUSH_BUT_LAST_FLUSH = 3


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
    logprobs: list[TokenLogprob] | None = None  # one per new token id, when asked for
    finish_message: str | None = None
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)  # so far (a few entries)
    spans_weight_versions: bool = False
    text_rule: TextRule = TextRule.IN_TEXT  # not IN_TEXT: `text` is "" until the receiver detokenizes
    spec: SpecDecodeStats | None = None  # on the finishing delta, when speculative decoding served it


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
    # once, on the delta of the step that scored the prompt's last position
    prompt_logprobs: PromptLogprobs | None = None


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
        self._logprobs: dict[int, list[TokenLogprob]] = {}
        self.prompt_logprobs: PromptLogprobs | None = None
        self._last: dict[int, CompletionDelta] = {}

    def add(self, delta: RequestDelta) -> None:
        if delta.request_id != self.request_id:
            raise ValueError(f"delta of {delta.request_id!r} given to the assembler of {self.request_id!r}")
        if delta.prompt_token_ids is not None:
            self.prompt, self.prompt_token_ids = delta.prompt, list(delta.prompt_token_ids)
            self.moe_layer_ids = delta.moe_layer_ids
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_cached_tokens = delta.num_cached_tokens
        self.finished = delta.finished
        for c in delta.outputs:
            self._texts.setdefault(c.index, []).append(c.text)
            self._token_ids.setdefault(c.index, []).extend(c.token_ids)
            if c.logprobs is not None:
                self._logprobs.setdefault(c.index, []).extend(c.logprobs)
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
                logprobs=list(self._logprobs.get(i, [])) if last.logprobs is not None else None,
                finish_message=last.finish_message,
                weight_versions=list(last.weight_versions),
                spans_weight_versions=last.spans_weight_versions,
                spec=last.spec,
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
            prompt_logprobs=self.prompt_logprobs,
        )
