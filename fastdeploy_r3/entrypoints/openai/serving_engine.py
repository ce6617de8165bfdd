"""What /v1/completions and /v1/chat/completions share: checks that map to HTTP errors, running a
request through the engine, and R3 delivery (DESIGN.md §7).

R3 delivery is r3/delivery.py's (shared with offline `LLM`); here it runs in a worker thread, awaited
before the response (or the stream's final chunks) goes out, so the event loop never encodes or waits
on a store. A failed delivery answers 500.

What a request may cost, and who it may touch (issue 11):

    prompt text   refused past request_limits.PromptCharBound before tokenizing; tokenized in a thread
    queue         the engine's waiting queue is bounded: 429 with Retry-After
    deadline      `timeout` of the request, else --request-timeout-s, from arrival: aborted, 504
    rollout id    one request at a time per id; an id whose R3 is already stored is refused (409)
                  unless the request says overwrite_rollout
    500s          say what failed and the request id; exception text and paths go to the log only
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastdeploy_r3.entrypoints.engine_client import (
    AsyncEngineClient,
    EngineOverloadedError,
    EngineRequestError,
    EngineUnavailableError,
)
from fastdeploy_r3.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, PromptTokensDetails, UsageInfo
from fastdeploy_r3.entrypoints.openai.request_limits import FALLBACK_LONGEST_TOKEN_CHARS, PromptCharBound
from fastdeploy_r3.lifecycle import EngineDeadError
from fastdeploy_r3.outputs import CompletionOutput, OutputAssembler, RequestDelta, RequestOutput
from fastdeploy_r3.r3.delivery import R3Delivery, R3DeliveryError, R3Result, R3StoreFailedError
from fastdeploy_r3.r3.rollout_id import InvalidRolloutIdError, resolve_rollout_id, validate_rollout_id
from fastdeploy_r3.r3.stores import RoutingStore, RoutingStoreError
from fastdeploy_r3.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger("fastdeploy_r3.api_server")

DEFAULT_REQUEST_TIMEOUT_S = 1800.0
RETRY_AFTER_S = 1


class OpenAIError(Exception):
    """An error answered as an OpenAI-style body with an HTTP status."""

    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.headers = headers

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status)
        return ErrorResponse(error=info).model_dump()


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)


def engine_error(message: str) -> OpenAIError:
    return OpenAIError(500, message, "internal_server_error")


def engine_unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, "service_unavailable")


def internal_error(what: str, request_id: str, detail: object) -> OpenAIError:
    """A 500 that says what failed and for which request; the detail (exception text, paths) is logged."""
    logger.error("request %s: %s: %s", request_id, what, detail)
    return OpenAIError(500, f"{what} (request {request_id}); the server log has the details", "internal_server_error")


def conflict(message: str, param: str) -> OpenAIError:
    return OpenAIError(409, message, "conflict_error", param)


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
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    longest_token_chars: int = FALLBACK_LONGEST_TOKEN_CHARS
    delivery: R3Delivery = field(init=False)
    prompt_bound: PromptCharBound = field(init=False)
    rollouts_in_flight: set[str] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self.delivery = R3Delivery(self.engine.config.routing_replay_config, self.store)
        self.prompt_bound = PromptCharBound(self.engine.info.max_model_len, self.longest_token_chars)

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

    async def claim_rollout(
        self, request_id: str, rollout_id: str, params: SamplingParams, overwrite: bool
    ) -> Callable[[], None]:
        """Hold `rollout_id` for this request; returns the release. Only stored R3 has an id to
        collide on: in response mode, or with R3 off for the request, nothing is held.

        In flight elsewhere -> 409; already in the store (any n) -> 409 unless `overwrite`."""
        store = self.ctx.store
        if store is None or not self.wants_r3(params):
            return lambda: None
        held = self.ctx.rollouts_in_flight
        if rollout_id in held:  # checked and taken with no await between: atomic on the loop
            raise conflict(f"rollout id {rollout_id!r} is in flight in another request; wait for its answer "
                           "or use another id", "rollout_id")
        held.add(rollout_id)
        try:
            if not overwrite:
                try:
                    stored = await asyncio.to_thread(store.contains, rollout_id, self.ctx.moe_layer_ids)
                except RoutingStoreError as e:
                    raise internal_error(f"the R3 store could not be read for rollout {rollout_id!r}",
                                         request_id, e) from e
                if stored:
                    raise conflict(f"rollout id {rollout_id!r} already has routed_experts in the store; use a new "
                                   "id, or send \"overwrite_rollout\": true to replace them", "rollout_id")
        except BaseException:
            held.discard(rollout_id)
            raise
        return lambda: held.discard(rollout_id)

    async def tokenize(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of prompt text: refused before tokenizing when it cannot fit; tokenized off the loop."""
        message = self.ctx.prompt_bound.check(len(text))
        if message is not None:
            raise bad_request(message, param)
        return await asyncio.to_thread(self.ctx.engine.tokenizer.encode, text, add_special_tokens)

    def deadline(self, timeout_s: float | None) -> float:
        """Loop time by which the request must be answered."""
        return asyncio.get_running_loop().time() + (timeout_s or self.ctx.request_timeout_s)

    def wants_r3(self, params: SamplingParams) -> bool:
        return self.ctx.delivery.wants(params.return_routed_experts)

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
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        deadline: float,
        release: Callable[[], None] = lambda: None,
    ) -> tuple[RequestDelta, AsyncIterator[RequestDelta]]:
        """Submit and wait for the first delta, so that a rejected request still gets its 4xx
        status (a stream cannot change its status once started). The returned generator ends the
        request at `deadline` (504) and calls `release` (the rollout id's claim) when it closes."""
        gen = self._bounded(request_id, self.ctx.engine.generate(request_id, prompt_token_ids, params, prompt),
                            deadline, release)
        try:
            first = await gen.__anext__()
        except InvalidRequestError as e:
            raise bad_request(str(e)) from e
        except EngineOverloadedError as e:
            raise OpenAIError(429, f"the server is busy: {e}", "rate_limit_error",
                              headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except EngineUnavailableError as e:  # memory released, weights missing: says what to call
            raise engine_unavailable(str(e)) from e
        except EngineRequestError as e:
            raise internal_error("the engine could not accept the request", request_id, e) from e
        except EngineDeadError as e:
            raise engine_unavailable(str(e)) from e
        except BaseException:
            await gen.aclose()
            raise
        return first, gen

    async def _bounded(
        self, request_id: str, gen: AsyncIterator[RequestDelta], deadline: float, release: Callable[[], None]
    ) -> AsyncIterator[RequestDelta]:
        """`gen` until `deadline`; past it the engine request is aborted and OpenAIError(504) raised."""
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        delta = await anext(gen)
                except StopAsyncIteration:
                    return
                except TimeoutError as e:
                    raise OpenAIError(
                        504, f"request {request_id} did not finish within its deadline and was aborted; send a "
                        "larger `timeout` (seconds) or fewer max_tokens", "timeout_error", "timeout") from e
                yield delta
                if delta.finished:
                    return
        finally:
            try:
                await gen.aclose()  # aborts the engine request unless it finished
            finally:
                release()

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
                # the engine's own message says what failed (a worker step, an R3 gather, the engine);
                # it is logged beside the request id, where the engine's log has the traceback
                self.ctx.counters.request_errors += 1
                message = c.error or "the engine failed this request without a message"
                logger.error("request %s choice %d failed: %s", final.request_id, c.index, message)
                raise engine_error(f"{message} (request {final.request_id})")

    # -- R3 ---------------------------------------------------------------------------------------

    async def deliver_r3(self, final: RequestOutput, params: SamplingParams, rollout_id: str) -> R3Result:
        if not self.wants_r3(params):
            return R3Result.nothing(len(final.outputs))
        counters, storing = self.ctx.counters, self.ctx.store is not None
        t0 = time.perf_counter()
        try:
            # encoding and store I/O block: keep them off the event loop, but finish before answering
            r3 = await asyncio.to_thread(self.ctx.delivery.deliver, final, rollout_id, True, params.routing_layout)
        except R3StoreFailedError as e:
            counters.r3_store_failures += 1
            raise internal_error(f"storing routed_experts of rollout {rollout_id!r} failed", final.request_id,
                                 e.__cause__ or e) from e
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


def choice_versions(c: CompletionOutput) -> dict[str, Any]:
    """The weight-version fields of a choice that lived through a weight update (none otherwise)."""
    if not c.spans_weight_versions:
        return {}
    return {"weight_versions": [dataclasses.asdict(s) for s in c.weight_versions], "spans_weight_versions": True}


def response_extras(final: RequestOutput, r3: R3Result) -> dict[str, Any]:
    """Response-level fields beside moe_layer_ids: the weights that produced it, the R3 layout sent."""
    spans = final.outputs[0].weight_versions if final.outputs else []
    return {"weight_version": spans[-1].version if spans else None, "routing_layout": r3.layout}


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
