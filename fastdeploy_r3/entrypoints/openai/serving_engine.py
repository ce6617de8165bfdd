"""What /v1/completions and /v1/chat/completions share: checks that map to HTTP errors, running a
request through the engine, and R3 delivery.

R3 delivery is r3/delivery.py's (shared with offline `LLM`); here it runs in a worker thread, awaited
before the response (or the stream's final chunks) goes out, so the event loop never encodes or waits
on a store. A failed delivery answers 500; a request the engine aborted (a pause, a weight update), 503
with the reason. What a request may cost, and who it may touch:

    prompt text   refused past request_limits.PromptCharBound before tokenizing; tokenized in a thread
    queue         the engine's waiting queue is bounded: 429 with Retry-After
    deadline      `timeout` of the request, else --request-timeout-s, from arrival: aborted, 504
    rollout id    one request at a time per id, across every server sharing the store (a reservation
                  in the store, r3/reservation.py); an id whose R3 is already stored is refused (409)
                  unless the request says overwrite_rollout; a writer that lost the id fails with 409
    500s          say what failed and the request id; exception text and paths go to the log only
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fastdeploy_r3.blobstore.health import StoreUnavailableError
from fastdeploy_r3.entrypoints.engine_client import (
    AsyncEngineClient,
    EngineOverloadedError,
    EngineRequestError,
    EngineUnavailableError,
)
from fastdeploy_r3.entrypoints.openai.deadline import bounded
from fastdeploy_r3.entrypoints.openai.errors import (  # noqa: F401 - the serving modules import them from here
    OpenAIError,
    bad_request,
    conflict,
    engine_error,
    engine_unavailable,
    internal_error,
)
from fastdeploy_r3.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo
from fastdeploy_r3.entrypoints.openai.request_limits import (
    FALLBACK_LONGEST_TOKEN_CHARS,
    PromptCharBound,
    RequestBounds,
)
from fastdeploy_r3.entrypoints.openai.rollout_claims import RolloutClaims
from fastdeploy_r3.entrypoints.payload_json import dumps_choices
from fastdeploy_r3.entrypoints.pd.handoff import Bootstrap, HandoffError
from fastdeploy_r3.entrypoints.pd.roles import PdDecode, PdPrefill, run_request
from fastdeploy_r3.lifecycle import EngineDeadError
from fastdeploy_r3.outputs import CompletionOutput, OutputAssembler, RequestDelta, RequestOutput
from fastdeploy_r3.r3.delivery import R3Delivery, R3DeliveryError, R3Result, R3RolloutConflictError, R3StoreFailedError
from fastdeploy_r3.r3.reservation import RolloutConflictError
from fastdeploy_r3.r3.rollout_id import InvalidRolloutIdError, resolve_rollout_id, validate_rollout_id
from fastdeploy_r3.r3.stores import RoutingStore, RoutingStoreError
from fastdeploy_r3.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger("fastdeploy_r3.api_server")

DEFAULT_REQUEST_TIMEOUT_S = 1800.0
RETRY_AFTER_S = 1


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
    generate_requests: int = 0  # /generate answers, but for those sent with log_metrics: false (SGLang's)


@dataclass
class ServingContext:
    engine: AsyncEngineClient
    served_model_name: str
    store: RoutingStore | None  # None: R3 goes in the response
    counters: ServerCounters = field(default_factory=ServerCounters)
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    longest_token_chars: int = FALLBACK_LONGEST_TOKEN_CHARS
    bounds: RequestBounds = field(default_factory=RequestBounds)
    enable_return_routed_experts: bool = False  # /generate answers carry R3 unless a request says false
    enable_memory_saver: bool = False  # SGLang's flag, as /server_info reports it (release/resume work anyway)
    pd: PdPrefill | PdDecode | None = None  # --disaggregation-mode prefill / decode (entrypoints/pd/roles.py)
    delivery: R3Delivery = field(init=False)
    prompt_bound: PromptCharBound = field(init=False)
    rollout_claims: RolloutClaims = field(init=False)

    def __post_init__(self) -> None:
        self.delivery = R3Delivery(self.engine.config.routing_replay_config, self.store)
        self.rollout_claims = RolloutClaims(self.delivery)
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
        self, request_id: str, rollout_id: str, params: SamplingParams, overwrite: bool, timeout_s: float | None = None
    ) -> Callable[[], None]:
        """Hold `rollout_id` for this request (rollout_claims.py); returns the release. Only stored R3
        has an id to collide on: in response mode, or with R3 off for the request, nothing is held.

        In flight here, or reserved in the store by another server -> 409; already in the store (any
        n) -> 409 unless `overwrite`."""
        if self.ctx.store is None or not self.wants_r3(params):
            return lambda: None
        try:
            return await self.ctx.rollout_claims.claim(rollout_id, overwrite, timeout_s or self.ctx.request_timeout_s)
        except RolloutConflictError as e:
            raise conflict(str(e), "rollout_id") from e
        except (RoutingStoreError, StoreUnavailableError) as e:
            raise internal_error(f"the R3 store could not reserve rollout {rollout_id!r}", request_id, e) from e

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
            mc = self.ctx.engine.config.model_config
            params = request.to_sampling_params(default_max_tokens, mc.generation_defaults)
            self.ctx.bounds.check(params, mc.vocab_size)
        except InvalidRequestError as e:
            raise bad_request(str(e)) from e
        return params

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
        boot: Bootstrap | None = None,
    ) -> tuple[RequestDelta, AsyncIterator[RequestDelta]]:
        """Submit and wait for the first delta, so that a rejected request still gets its 4xx
        status (a stream cannot change its status once started). The returned generator ends the
        request at `deadline` (504) and calls `release` (the rollout id's claim) when it closes (PD: `boot`)."""
        gen = bounded(request_id, run_request(self.ctx.pd, self.ctx.engine, request_id, prompt_token_ids,
                                                    params, prompt, boot, deadline), deadline, release)
        try:
            first = await gen.__anext__()
        except InvalidRequestError as e:
            raise bad_request(str(e)) from e
        except EngineOverloadedError as e:
            raise OpenAIError(429, f"the server is busy: {e}", "rate_limit_error",
                              headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except EngineUnavailableError as e:  # memory released, weights missing: says what to call
            raise engine_unavailable(str(e)) from e
        except HandoffError as e:  # the prefill server did not hand the request over
            raise OpenAIError(502, str(e), "bad_gateway_error") from e
        except EngineRequestError as e:
            raise internal_error("the engine could not accept the request", request_id, e) from e
        except EngineDeadError as e:
            raise engine_unavailable(str(e)) from e
        except BaseException:
            await gen.aclose()
            raise
        return first, gen

    async def iterate(self, gen: AsyncIterator[RequestDelta]) -> AsyncIterator[RequestDelta]:
        try:
            async for out in gen:
                yield out
        except EngineDeadError as e:
            raise engine_unavailable(str(e)) from e
        except EngineRequestError as e:
            raise engine_error(str(e)) from e

    async def finish_and_deliver(
        self, first: RequestDelta, gen: AsyncIterator[RequestDelta], params: SamplingParams, rollout_id: str
    ) -> tuple[RequestOutput, R3Result]:
        """The whole request, then its R3 delivered, before the generator closes: the rollout id stays
        claimed until its R3 is stored."""
        try:
            final = await self.run_to_completion(first, gen, close=False)
            return final, await self.deliver_r3(final, params, rollout_id)
        finally:
            await gen.aclose()

    async def run_to_completion(
        self, first: RequestDelta, gen: AsyncIterator[RequestDelta], close: bool = True
    ) -> RequestOutput:
        assembler = OutputAssembler(first.request_id)
        assembler.add(first)
        try:
            if not first.finished:
                async for delta in self.iterate(gen):
                    assembler.add(delta)
                    if delta.finished:
                        break  # the generator is left open: its close releases the rollout id
        finally:
            if close:
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
        if aborted := [c.finish_message or "aborted" for c in final.outputs if c.finish_reason == "abort"]:
            raise engine_unavailable(f"{aborted[0]}; no routed_experts to deliver (request {final.request_id})")
        counters, storing = self.ctx.counters, self.ctx.store is not None
        t0 = time.perf_counter()
        try:
            # encoding and store I/O block: keep them off the event loop, but finish before answering
            claim = self.ctx.rollout_claims.get(rollout_id) if storing else None
            deliver = partial(self.ctx.delivery.deliver, overwrite=claim is not None and claim.overwrite,
                              reservation=claim.reservation if claim is not None else None)
            r3 = await asyncio.to_thread(deliver, final, rollout_id, True, params.routing_layout)
        except R3RolloutConflictError as e:
            counters.r3_store_failures += 1
            raise conflict(f"{e} (request {final.request_id})", "rollout_id") from e
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


def sse(payload: dict | str) -> str:  # a chunk's R3 payloads spliced, not scanned (payload_json.py)
    return f"data: {payload if isinstance(payload, str) else dumps_choices(payload)}\n\n"


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
