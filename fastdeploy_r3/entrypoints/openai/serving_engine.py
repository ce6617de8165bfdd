"""What /v1/completions and /v1/chat/completions share: checks that map to HTTP errors, running a
request through the engine, and R3 delivery (DESIGN.md §7).

R3 delivery is r3/delivery.py's (shared with offline `LLM`); here it runs in a worker thread, awaited
before the response (or the stream's final chunks) goes out, so the event loop never encodes or waits
on a store. A failed delivery answers 500.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastdeploy_r3.entrypoints.engine_client import AsyncEngineClient, EngineRequestError
from fastdeploy_r3.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, PromptTokensDetails, UsageInfo
from fastdeploy_r3.lifecycle import EngineDeadError
from fastdeploy_r3.outputs import OutputAssembler, RequestDelta, RequestOutput
from fastdeploy_r3.r3.delivery import R3Delivery, R3DeliveryError, R3Result, R3StoreFailedError
from fastdeploy_r3.r3.rollout_id import InvalidRolloutIdError, resolve_rollout_id, validate_rollout_id
from fastdeploy_r3.r3.stores import RoutingStore
from fastdeploy_r3.sampling_params import InvalidRequestError, SamplingParams


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
    r3_store_evicted: int = 0  # local store: rollouts dropped for capacity (least recently used first)
    r3_store_expired: int = 0  # local store: rollouts dropped for age (ttl_s)


@dataclass
class ServingContext:
    engine: AsyncEngineClient
    served_model_name: str
    store: RoutingStore | None  # None: R3 goes in the response
    counters: ServerCounters = field(default_factory=ServerCounters)
    delivery: R3Delivery = field(init=False)

    def __post_init__(self) -> None:
        self.delivery = R3Delivery(self.engine.config.routing_replay_config, self.store)

    @property
    def r3_enabled(self) -> bool:
        return self.engine.config.routing_replay_config.enable_routing_replay

    @property
    def moe_layer_ids(self) -> list[int]:
        return self.delivery.moe_layer_ids


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

    def check_r3_request(
        self, return_routed_experts: bool | None, rollout_id: str | None, user: str | None, request_id: str
    ) -> str:
        """Validate the R3 extras; return the rollout id for store delivery (r3/rollout_id.py's rule).

        An explicit rollout_id is always checked; the `user` field only where a store will use it.
        """
        if return_routed_experts and not self.ctx.r3_enabled:
            raise bad_request(
                "return_routed_experts is true but routing replay is off on this server; start it with "
                "--routing-replay-config '{\"enable_routing_replay\": true}'",
                "return_routed_experts",
            )
        try:
            if self.ctx.store is None:
                return request_id if rollout_id is None else validate_rollout_id(rollout_id)
            return resolve_rollout_id(rollout_id, user, request_id)
        except InvalidRolloutIdError as e:
            raise bad_request(str(e), "rollout_id" if rollout_id is not None else "user") from e

    def wants_r3(self, params: SamplingParams) -> bool:
        return self.ctx.delivery.wants(params.return_routed_experts)

    def sampling_params(self, request, default_max_tokens: int) -> SamplingParams:
        try:
            return request.to_sampling_params(default_max_tokens)
        except InvalidRequestError as e:
            raise bad_request(str(e)) from e

    @staticmethod
    def new_request_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    # -- running ----------------------------------------------------------------------------------

    async def start_generation(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None
    ) -> tuple[RequestDelta, AsyncIterator[RequestDelta]]:
        """Submit and wait for the first delta, so that a rejected request still gets its 4xx
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

    async def iterate(self, gen: AsyncIterator[RequestDelta]) -> AsyncIterator[RequestDelta]:
        try:
            async for out in gen:
                yield out
        except EngineDeadError as e:
            raise engine_unavailable(str(e)) from e
        except EngineRequestError as e:
            raise engine_error(str(e)) from e

    async def run_to_completion(self, first: RequestDelta, gen: AsyncIterator[RequestDelta]) -> RequestOutput:
        assembler = OutputAssembler(first.request_id)
        assembler.add(first)
        try:
            if not first.finished:
                async for delta in self.iterate(gen):
                    assembler.add(delta)
        finally:
            await gen.aclose()
        final = assembler.output()
        self.check_finished_ok(final)
        return final

    def check_finished_ok(self, final: RequestOutput) -> None:
        for c in final.outputs:
            if c.finish_reason == "error":
                self.ctx.counters.request_errors += 1
                raise engine_error(c.error or "the engine failed this request without a message")

    # -- R3 ---------------------------------------------------------------------------------------

    async def deliver_r3(self, final: RequestOutput, params: SamplingParams, rollout_id: str) -> R3Result:
        if not self.wants_r3(params):
            return R3Result.nothing(len(final.outputs))
        counters, storing = self.ctx.counters, self.ctx.store is not None
        t0 = time.perf_counter()
        try:
            # encoding and store I/O block: keep them off the event loop, but finish before answering
            r3 = await asyncio.to_thread(self.ctx.delivery.deliver, final, rollout_id)
        except R3StoreFailedError as e:
            counters.r3_store_failures += 1
            raise engine_error(str(e)) from e
        except R3DeliveryError as e:
            raise engine_error(f"{e}; refusing to deliver it") from e
        finally:
            if storing:
                counters.r3_store_put_seconds += time.perf_counter() - t0
        if storing:
            counters.r3_store_puts += 1
            budget = getattr(self.ctx.store, "budget", None)
            if budget is not None:
                counters.r3_store_evicted, counters.r3_store_expired = budget.counters.evicted, budget.counters.expired
        counters.r3_response_payload_bytes += r3.payload_bytes
        return r3

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


async def stream_events(
    serving: OpenAIServing,
    first: RequestDelta,
    gen: AsyncIterator[RequestDelta],
    params: SamplingParams,
    rollout_id: str,
    make_delta_chunks: Callable[[RequestDelta, set[int]], list[dict]],
    make_final_chunks: Callable[[RequestOutput, R3Result], list[dict]],
    make_usage_chunk: Callable[[RequestOutput], dict] | None,
) -> AsyncIterator[str]:
    """SSE for one request: the engine's text deltas as they come (make_delta_chunks gets the set of
    choice indices already streamed, to add to); then, once the request finished and its R3 is
    delivered, each choice's final chunk (finish_reason + routed_experts); then [DONE].
    An error after the stream started is sent as an OpenAI error event."""
    assembler = OutputAssembler(first.request_id)
    streamed: set[int] = set()
    try:
        assembler.add(first)
        for chunk in make_delta_chunks(first, streamed):
            yield sse(chunk)
        if not first.finished:
            async for delta in serving.iterate(gen):
                assembler.add(delta)
                for chunk in make_delta_chunks(delta, streamed):
                    yield sse(chunk)
        final = assembler.output()
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
