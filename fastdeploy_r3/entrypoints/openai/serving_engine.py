"""What /v1/completions and /v1/chat/completions share: checks that map to HTTP errors, running a
request through the engine, and R3 delivery (DESIGN.md §7).

R3 delivery of one finished request:

    response mode   choice.routed_experts = base64(.npy [rows, L, K]), choice.routed_experts_start
    local/p2pstore  store.put(rollout_id, [choice arrays]) in a worker thread, awaited before the
                    response (or the stream's final chunks) goes out; a failed put fails the request
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import numpy as np

from fastdeploy_r3.cache_manager.routing_store import (
    InvalidRolloutIdError,
    RoutingStore,
    RoutingStoreError,
    validate_rollout_id,
)
from fastdeploy_r3.client.routed_experts import encode_routed_experts
from fastdeploy_r3.engine.request import CompletionOutput, RequestOutput
from fastdeploy_r3.engine.sampling_params import InvalidRequestError, SamplingParams
from fastdeploy_r3.entrypoints.engine_client import AsyncEngineClient, EngineDeadError, EngineRequestError
from fastdeploy_r3.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, PromptTokensDetails, UsageInfo

DEFAULT_ROLLOUT_ID = "user"


class OpenAIError(Exception):
    """An error answered as an OpenAI-style body with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status)
        return ErrorResponse(error=info).model_dump()


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)


def engine_error(message: str) -> OpenAIError:
    return OpenAIError(500, message, "internal_server_error")


def engine_unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, "service_unavailable")


@dataclass
class ServerCounters:
    """R3 delivery counters of the API server (the engine keeps its own)."""

    r3_store_puts: int = 0
    r3_store_failures: int = 0
    r3_store_put_seconds: float = 0.0
    r3_response_payload_bytes: int = 0
    request_errors: int = 0


@dataclass
class ServingContext:
    engine: AsyncEngineClient
    served_model_name: str
    store: RoutingStore | None  # None: R3 goes in the response
    counters: ServerCounters = field(default_factory=ServerCounters)

    @property
    def r3_enabled(self) -> bool:
        return self.engine.config.routing_replay_config.enable_routing_replay

    @property
    def moe_layer_ids(self) -> list[int]:
        return list(self.engine.config.routing_replay_config.moe_layer_ids or [])


@dataclass
class R3Result:
    """Per choice: base64 payload (response mode) and start row; None when not delivered inline."""

    payloads: list[str | None]
    starts: list[int | None]


class OpenAIServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    # -- checks -----------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.ctx.served_model_name:
            raise OpenAIError(
                404,
                f"model {model!r} does not exist; this server serves {self.ctx.served_model_name!r}",
                "NotFoundError",
                "model",
            )

    def check_r3_request(self, return_routed_experts: bool | None, rollout_id: str | None) -> str:
        """Validate the R3 extras; return the rollout id used for store delivery."""
        if return_routed_experts and not self.ctx.r3_enabled:
            raise bad_request(
                "return_routed_experts is true but routing replay is off on this server; start it with "
                "--routing-replay-config '{\"enable_routing_replay\": true}'",
                "return_routed_experts",
            )
        rid = DEFAULT_ROLLOUT_ID if rollout_id is None else rollout_id
        try:
            return validate_rollout_id(rid)
        except InvalidRolloutIdError as e:
            raise bad_request(str(e), "rollout_id") from e

    def wants_r3(self, params: SamplingParams) -> bool:
        return self.ctx.r3_enabled and params.return_routed_experts is not False

    def sampling_params(self, request, default_max_tokens: int) -> SamplingParams:
        try:
            return request.to_sampling_params(
                default_max_tokens, self.ctx.engine.config.model_config.generation_defaults
            )
        except InvalidRequestError as e:
            raise bad_request(str(e)) from e

    @staticmethod
    def new_request_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    # -- running ----------------------------------------------------------------------------------

    async def start_generation(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None
    ) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
        """Submit and wait for the first output, so that a rejected request still gets its 4xx
        status (a stream cannot change its status once started)."""
        gen = self.ctx.engine.generate(request_id, prompt_token_ids, params, prompt)
        try:
            first = await gen.__anext__()
        except InvalidRequestError as e:
            raise bad_request(str(e)) from e
        except EngineRequestError as e:
            raise engine_error(str(e)) from e
        except EngineDeadError as e:
            raise engine_unavailable(str(e)) from e
        return first, gen

    async def iterate(self, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        try:
            async for out in gen:
                yield out
        except EngineDeadError as e:
            raise engine_unavailable(str(e)) from e
        except EngineRequestError as e:
            raise engine_error(str(e)) from e

    async def run_to_completion(self, first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> RequestOutput:
        final = first
        try:
            if not first.finished:
                async for out in self.iterate(gen):
                    final = out
        finally:
            await gen.aclose()
        self.check_finished_ok(final)
        return final

    def check_finished_ok(self, final: RequestOutput) -> None:
        for c in final.outputs:
            if c.finish_reason == "error":
                self.ctx.counters.request_errors += 1
                raise engine_error(c.error or "the engine failed this request without a message")

    # -- R3 ---------------------------------------------------------------------------------------

    async def deliver_r3(self, final: RequestOutput, params: SamplingParams, rollout_id: str) -> R3Result:
        n = len(final.outputs)
        none = R3Result([None] * n, [None] * n)
        if not self.wants_r3(params):
            return none
        arrays: list[np.ndarray] = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            if c.routed_experts is None:
                # fail closed: the caller asked for R3 and a trainer would replay nothing
                raise engine_error(f"the engine returned no routed_experts for choice {c.index} of {final.request_id}")
            self._check_r3_rows(final, c)
            arrays.append(c.routed_experts)
        starts: list[int | None] = [c.routed_experts_start for c in sorted(final.outputs, key=lambda c: c.index)]
        store = self.ctx.store
        if store is None:
            payloads: list[str | None] = [encode_routed_experts(a) for a in arrays]
            self.ctx.counters.r3_response_payload_bytes += sum(len(p or "") for p in payloads)
            return R3Result(payloads, starts)
        t0 = time.perf_counter()
        try:
            # blocking disk / network I/O: keep it off the event loop, but finish before answering
            await asyncio.to_thread(store.put, rollout_id, arrays, self.ctx.moe_layer_ids)
        except (RoutingStoreError, OSError) as e:
            self.ctx.counters.r3_store_failures += 1
            raise engine_error(f"storing routed_experts of rollout {rollout_id!r} failed: {e}") from e
        finally:
            self.ctx.counters.r3_store_put_seconds += time.perf_counter() - t0
        self.ctx.counters.r3_store_puts += 1
        return R3Result([None] * n, starts)

    def _check_r3_rows(self, final: RequestOutput, c: CompletionOutput) -> None:
        """Last line of fail-closed: never hand a trainer rows that cannot be the ones it asked for."""
        rr = self.ctx.engine.config.routing_replay_config
        arr = c.routed_experts
        assert arr is not None
        rows = len(final.prompt_token_ids) + len(c.token_ids) - 1 - c.routed_experts_start
        want = (rows, rr.num_moe_layers, rr.moe_top_k)
        if arr.shape != want or arr.dtype != rr.routing_dtype:
            raise engine_error(
                f"routed_experts of choice {c.index} of {final.request_id} is {arr.dtype}{list(arr.shape)}, "
                f"expected {rr.routing_dtype}{list(want)}; refusing to deliver it"
            )
        holes = np.argwhere((arr == rr.sentinel).any(axis=-1))  # [holes, 2]: (row, layer)
        if len(holes):
            row, layer = holes[0]
            raise engine_error(
                f"routed_experts of choice {c.index} of {final.request_id}: row {row + c.routed_experts_start} "
                f"layer {self.ctx.moe_layer_ids[layer]} holds the no-route sentinel; refusing to deliver it"
            )

    def response_moe_layer_ids(self, params: SamplingParams) -> list[int] | None:
        return self.ctx.moe_layer_ids if self.wants_r3(params) else None

    @staticmethod
    def usage(final: RequestOutput) -> UsageInfo:
        p = len(final.prompt_token_ids)
        n = sum(len(c.token_ids) for c in final.outputs)
        details = PromptTokensDetails(cached_tokens=final.num_cached_tokens)
        return UsageInfo(prompt_tokens=p, completion_tokens=n, total_tokens=p + n, prompt_tokens_details=details)


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class StreamDeltas:
    """Turns cumulative outputs into per-choice text deltas."""

    def __init__(self) -> None:
        self.sent_text: dict[int, int] = {}

    def delta(self, index: int, text: str) -> str:
        start = self.sent_text.get(index, 0)
        self.sent_text[index] = len(text)
        return text[start:]


async def stream_events(
    serving: OpenAIServing,
    first: RequestOutput,
    gen: AsyncIterator[RequestOutput],
    params: SamplingParams,
    rollout_id: str,
    make_delta_chunks: Callable[[RequestOutput, StreamDeltas], list[dict]],
    make_final_chunks: Callable[[RequestOutput, R3Result], list[dict]],
    make_usage_chunk: Callable[[RequestOutput], dict] | None,
) -> AsyncIterator[str]:
    """SSE for one request: text deltas as they come; then, once the request finished and its R3
    is delivered, each choice's final chunk (finish_reason + routed_experts); then [DONE].
    An error after the stream started is sent as an OpenAI error event."""
    deltas = StreamDeltas()
    try:
        final = first
        for chunk in make_delta_chunks(first, deltas):
            yield sse(chunk)
        if not first.finished:
            async for out in serving.iterate(gen):
                final = out
                for chunk in make_delta_chunks(out, deltas):
                    yield sse(chunk)
        serving.check_finished_ok(final)
        r3 = await serving.deliver_r3(final, params, rollout_id)
        for chunk in make_final_chunks(final, r3):
            yield sse(chunk)
        if make_usage_chunk is not None:
            yield sse(make_usage_chunk(final))
    except OpenAIError as e:
        yield sse(e.body())
    finally:
        await gen.aclose()  # aborts the request in the engine if the client went away
    yield sse("[DONE]")
