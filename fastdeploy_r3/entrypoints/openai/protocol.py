"""OpenAI-compatible request and response bodies, plus the R3 extras (DESIGN.md §7).

R3 extras on requests: `return_routed_experts`, `routed_experts_start`, `rollout_id`; on responses:
each choice's `routed_experts` (base64 `.npy`, `[rows, L, K]`) and `routed_experts_start`, and the
response's `moe_layer_ids`. Unknown request fields are rejected (400) rather than silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fastdeploy_r3.r3.rollout_id import MAX_CHOICES
from fastdeploy_r3.sampling_params import SamplingParams


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class StreamOptions(StrictModel):
    include_usage: bool = False


class _SamplingFields(StrictModel):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # R3
    return_routed_experts: bool | None = None
    routed_experts_start: int = Field(default=0, ge=0)
    rollout_id: str | None = None

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            max_tokens=self._max_tokens() or default_max_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            return_routed_experts=self.return_routed_experts,
            routed_experts_start=self.routed_experts_start,
        )

    def _max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_SamplingFields):
    # a batch (list of prompts) is accepted only with one element: one request, one rollout
    prompt: str | list[int] | list[str] | list[list[int]]


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (any tier)


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class _R3Choice(OpenAIBaseModel):
    # None when R3 is off for the request or it goes to a store instead of the response
    routed_experts: str | None = None
    routed_experts_start: int | None = None


class CompletionChoice(_R3Choice):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def _now() -> int:
    return int(time.time())


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    moe_layer_ids: list[int] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatMessageOut(OpenAIBaseModel):
    role: str = "assistant"
    content: str


class ChatCompletionChoice(_R3Choice):
    index: int
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    moe_layer_ids: list[int] | None = None


class ChatCompletionStreamChoice(_R3Choice):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    moe_layer_ids: list[int] | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    moe_layer_ids: list[int] | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "fastdeploy_r3"
    root: str | None = None
    max_model_len: int | None = None
    # R3 facts a trainer (and tools/test_r3_swap.py) needs to interpret routed_experts
    r3: dict[str, Any] | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
