"""OpenAI-compatible request and response bodies, plus the R3 extras.

R3 extras on requests: `return_routed_experts`, `routed_experts_start`, `rollout_id`,
`overwrite_rollout`, `routing_layout`; on responses: each choice's `routed_experts` (base64 `.npy`,
`[rows, L, K]`, or `[rows, num_hidden_layers, K]` in the all_layers layout) and `routed_experts_start`,
and the response's `moe_layer_ids` and `routing_layout`. Every response says which weights produced it
(`weight_version`); a choice that lived through a weight update also carries SGLang's
`weight_versions` spans and `spans_weight_versions: true`. Also on requests: `timeout` (seconds).
Unknown request fields, and values of the wrong JSON type, are rejected (400) rather than silently
ignored or coerced.

Token extras (vLLM's names): `return_token_ids` puts each choice's `token_ids` and the response's
`prompt_token_ids` in the answer (completions also on the choice, where vLLM puts them); logprobs
follow OpenAI's shapes (logprobs_format.py) with the project's definition (fastdeploy_r3/logprobs.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fastdeploy_r3.entrypoints.openai.logprobs_format import ChatLogprobs, CompletionLogprobs
from fastdeploy_r3.logprobs import MAX_LOGPROBS
from fastdeploy_r3.r3.rollout_id import MAX_CHOICES
from fastdeploy_r3.sampling_params import InvalidRequestError, SamplingParams


class StrictModel(BaseModel):
    # Request bodies: unknown fields, and values of the wrong JSON type ("yes" for a bool, "5" for an
    # int), are a 400 rather than coerced; NaN and Infinity (which Python's JSON parser accepts) too
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


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
    min_tokens: int = Field(default=0, ge=0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # R3
    return_routed_experts: bool | None = None
    routed_experts_start: int = Field(default=0, ge=0)
    rollout_id: str | None = None
    # a rollout id in flight or already stored is refused (409) unless the request asks to overwrite
    overwrite_rollout: bool = False
    # seconds from arrival until the request is aborted (504); None: the server's --request-timeout-s
    timeout: float | None = Field(default=None, gt=0)
    routing_layout: Literal["moe", "all_layers"] | None = None
    # prefill/decode disaggregation: sglang-router --pd-disaggregation adds these (entrypoints/pd/), and
    # SGLang's no_stop_trim (= include_stop_str_in_output) and return_hidden_states (only false is served)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    no_stop_trim: bool = False
    return_hidden_states: Literal[False] = False

    def to_sampling_params(
        self, default_max_tokens: int, generation_defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        """generation_defaults (the model's generation_config.json, ModelConfig.generation_defaults) fill
        the sampling fields this request did not set, as vLLM does; a field the request sets wins, and
        the model's max_tokens only lowers default_max_tokens."""
        defaults = dict(generation_defaults or {})
        if self._max_tokens() is None and "max_tokens" in defaults:
            default_max_tokens = min(default_max_tokens, int(defaults["max_tokens"]))
        defaults.pop("max_tokens", None)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        kw: dict[str, Any] = dict(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            max_tokens=self._max_tokens() or default_max_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=self._logprobs(),
            prompt_logprobs=self._prompt_logprobs(),
            include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
            skip_special_tokens=self.skip_special_tokens,
            return_routed_experts=self.return_routed_experts,
            routed_experts_start=self.routed_experts_start,
            routing_layout=self.routing_layout,
        )
        for name, value in defaults.items():
            if name in kw and name not in self.model_fields_set:
                kw[name] = value
        return SamplingParams(**kw)

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return None

    def _prompt_logprobs(self) -> int | None:
        return None


class CompletionRequest(_SamplingFields):
    # a batch (list of prompts) is accepted only with one element: one request, one rollout
    prompt: str | list[int] | list[str] | list[list[int]]
    # the number of alternatives per token (OpenAI allows 5, vLLM 20); 0 = the chosen token's only
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt first in text (and, with logprobs, its logprobs, the first None)

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None  # handed to the chat template, as transformers does
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # SGLang's, sent by sglang-router with every chat request: reasoning is separated only by a server
    # started with a reasoning parser (this one has none, so they change nothing, as on such an SGLang
    # server); continuing the last assistant message is not served, only false passes
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    continue_final_message: Literal[False] = False

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def _logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError(f"top_logprobs={self.top_logprobs} needs logprobs=true; set both")
        return (self.top_logprobs or 0) if self.logprobs else None


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
    # only for a choice that lived through a weight update (SGLang's spans of output tokens)
    weight_versions: list[dict[str, Any]] | None = None
    spans_weight_versions: bool | None = None


class CompletionChoice(_R3Choice):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids
    prompt_token_ids: list[int] | None = None


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
    prompt_token_ids: list[int] | None = None
    routing_layout: str | None = None
    weight_version: str | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatMessageOut(OpenAIBaseModel):
    role: str = "assistant"
    content: str


class ChatCompletionChoice(_R3Choice):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    moe_layer_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    routing_layout: str | None = None
    weight_version: str | None = None


class ChatCompletionStreamChoice(_R3Choice):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's new ids


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    moe_layer_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first chunk
    routing_layout: str | None = None
    weight_version: str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    moe_layer_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    routing_layout: str | None = None
    weight_version: str | None = None


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
