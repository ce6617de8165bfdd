"""SGLang's native `POST /generate`, the endpoint slime and other RL frameworks sample rollouts with.

    request    text | input_ids (one prompt or a batch), sampling_params (SGLang names), rid, stream,
               return_logprob, return_routed_experts, routed_experts_start_len
    response   {"text", "output_ids", "meta_info"} per prompt and choice: a dict for one prompt with
               n == 1, else a list (prompt-major, then choices)
    meta_info  id, finish_reason ({"type": "stop"|"length"|"abort", ...}), prompt_tokens,
               completion_tokens, cached_tokens, e2e_latency, weight_version, weight_versions (spans
               of output tokens per version that sampled them), spans_weight_versions (tokens, KV or R3
               of more than one version: a request held in place across an update), and on request
               output_token_logprobs ([logprob, token_id, text|None] per token; the engine's logprobs of the
               distribution sampled from, after temperature, once it computes them) and routed_experts

`routed_experts` is SGLang's encoding, what slime decodes: base64 of raw little-endian int32
`[prompt_tokens + completion_tokens - 1 - routed_experts_start_len, num_hidden_layers, K]`, every hidden
layer a row (dense layers hold the routing dtype's no-route sentinel). Streaming sends SGLang's
cumulative chunks (`data: {...}`, text and output_ids so far), R3 in the last one, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse, StreamingResponse

from fastdeploy_r3.entrypoints.native.protocol import GenerateRequest, sglang_sampling_params
from fastdeploy_r3.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing, bad_request, engine_error
from fastdeploy_r3.outputs import CompletionOutput, OutputAssembler, RequestDelta, RequestOutput
from fastdeploy_r3.r3.codec import encode_sglang_routed_experts
from fastdeploy_r3.r3.delivery import R3DeliveryError
from fastdeploy_r3.r3.layouts import to_all_layers
from fastdeploy_r3.sampling_params import InvalidRequestError, SamplingParams


def sglang_routed_experts(moe_rows: np.ndarray, moe_layer_ids: list[int], num_hidden_layers: int) -> str:
    """[R, L, K] MoE rows -> SGLang's payload: base64 of raw int32 [R, num_hidden_layers, K]."""
    return encode_sglang_routed_experts(to_all_layers(moe_rows, moe_layer_ids, num_hidden_layers))


# per-token logprobs computed by the engine (SamplingParams.logprobs, issue 10 part A), when it has them
_ENGINE_LOGPROBS = "logprobs" in {f.name for f in dataclasses.fields(SamplingParams)}


def _value(logprob: Any) -> float | None:
    """A logprob entry as a number: the engine's record (TokenLogprob.logprob) or a plain float."""
    return getattr(logprob, "logprob", logprob)


def finish_reason(c: CompletionOutput) -> dict[str, Any] | None:
    """SGLang's finish_reason object of a choice (None while it runs)."""
    if c.finish_reason is None:
        return None
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    if c.finish_reason == "abort":
        return {"type": "abort", "message": c.finish_message or "the request was aborted"}
    matched = c.stop_reason if c.stop_reason is not None else (c.token_ids[-1] if c.token_ids else None)
    return {"type": "stop", "matched": matched}


class _Item:
    """One prompt of a /generate call."""

    def __init__(self, rid: str, prompt_token_ids: list[int], text: str | None, params: SamplingParams,
                 return_logprob: bool, return_text_in_logprobs: bool) -> None:
        self.rid = rid
        self.prompt_token_ids = prompt_token_ids
        self.text = text
        self.params = params
        self.return_logprob = return_logprob
        self.return_text_in_logprobs = return_text_in_logprobs


def _per_item(value: Any, n: int, what: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise bad_request(f"{what} has {len(value)} entries for {n} prompts; send one per prompt or one for all",
                              what)
        return value
    return [value] * n


class NativeServing(OpenAIServing):
    async def items(self, body: GenerateRequest) -> tuple[list[_Item], bool]:
        """The prompts of a request and whether it was a single one (answered with a dict)."""
        if (body.text is None) == (body.input_ids is None):
            raise bad_request("send exactly one of text or input_ids")
        for name in ("lora_path", "image_data", "session_params"):
            if getattr(body, name) is not None:
                raise bad_request(f"{name} is not supported by this server (text-only, no LoRA, no sessions)", name)
        texts: list[str | None]
        if body.text is not None:
            single = isinstance(body.text, str)
            texts = [body.text] if isinstance(body.text, str) else list(body.text)
            if self.ctx.engine.tokenizer is None:
                raise bad_request("this model has no tokenizer; send input_ids", "text")
            ids = [await self.tokenize(t, "text") for t in texts]  # type: ignore[arg-type]  # bounded, off the loop
        else:
            raw = body.input_ids or []
            single = not raw or isinstance(raw[0], int)
            ids = [list(raw)] if single else [list(x) for x in raw]  # type: ignore[arg-type]
            texts = [None] * len(ids)
        n = len(ids)
        if n == 0:
            raise bad_request("the batch is empty; send at least one prompt")
        if any(x != -1 for x in _per_item(body.logprob_start_len, n, "logprob_start_len")):
            raise bad_request("logprob_start_len: prompt logprobs are not computed by this server; send -1",
                              "logprob_start_len")
        top_logprobs = _per_item(body.top_logprobs_num, n, "top_logprobs_num")
        if any(x != 0 for x in top_logprobs) and not _ENGINE_LOGPROBS:
            raise bad_request("top_logprobs_num: this engine computes no top logprobs; send 0", "top_logprobs_num")
        if body.return_routed_experts and not self.ctx.r3_enabled:
            raise bad_request("return_routed_experts is true but routing replay is off on this server; start it "
                              "with --routing-replay-config '{\"enable_routing_replay\": true}'",
                              "return_routed_experts")
        if body.rid is None:
            rids = [uuid.uuid4().hex for _ in range(n)]
        elif isinstance(body.rid, str):
            rids = [body.rid] if single else [f"{body.rid}_{i}" for i in range(n)]
        else:
            rids = _per_item(body.rid, n, "rid")
        sampling = _per_item(body.sampling_params, n, "sampling_params")
        logprob = _per_item(body.return_logprob, n, "return_logprob")
        items = []
        for i in range(n):
            try:
                params = sglang_sampling_params(sampling[i], body.return_routed_experts, body.routed_experts_start_len)
                if logprob[i] and _ENGINE_LOGPROBS:  # the engine's per-token logprobs (SGLang's definition)
                    params = dataclasses.replace(params, logprobs=int(top_logprobs[i]))  # type: ignore[call-arg]
            except InvalidRequestError as e:
                raise bad_request(str(e), "sampling_params") from e
            items.append(_Item(rids[i], ids[i], texts[i], params, bool(logprob[i]), body.return_text_in_logprobs))
        return items, single

    # -- answers ------------------------------------------------------------------------------------

    def result(self, item: _Item, out: RequestOutput, c: CompletionOutput, started: float,
               routed_experts: str | None) -> dict[str, Any]:
        spans = [{"version": s.version, "start": s.start, "end": s.end} for s in c.weight_versions]
        meta: dict[str, Any] = {
            "id": item.rid if len(out.outputs) == 1 else f"{item.rid}#{c.index}",
            "finish_reason": finish_reason(c),
            "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": len(c.token_ids),
            "cached_tokens": out.num_cached_tokens,
            "e2e_latency": time.monotonic() - started,
            "weight_version": spans[-1]["version"] if spans else None,
            "weight_versions": spans,
            "spans_weight_versions": c.spans_weight_versions,
        }
        if item.return_logprob:
            meta["output_token_logprobs"] = self._output_token_logprobs(c, item.return_text_in_logprobs)
            if getattr(item.params, "logprobs", None):
                meta["output_top_logprobs"] = self._output_top_logprobs(c, item.return_text_in_logprobs)
        if routed_experts is not None:
            meta["routed_experts"] = routed_experts
        return {"text": c.text, "output_ids": list(c.token_ids), "meta_info": meta}

    def _token_text(self, token_id: int, wanted: bool) -> str | None:
        tokenizer = self.ctx.engine.tokenizer
        return tokenizer.decode([token_id], skip_special_tokens=False) if wanted and tokenizer is not None else None

    def _output_token_logprobs(self, c: CompletionOutput, with_text: bool) -> list[list[Any]]:
        """[logprob, token_id, text] per output token (text only with return_text_in_logprobs); the logprob
        is None where the engine returned none."""
        logprobs = getattr(c, "logprobs", None) or []
        return [[_value(logprobs[i]) if i < len(logprobs) else None, t, self._token_text(t, with_text)]
                for i, t in enumerate(c.token_ids)]

    def _output_top_logprobs(self, c: CompletionOutput, with_text: bool) -> list[list[list[Any]]]:
        """SGLang's output_top_logprobs: per output token, [logprob, token_id, text] of the N most likely."""
        return [[[lp, tid, self._token_text(tid, with_text)] for tid, lp in getattr(x, "top", [])]
                for x in getattr(c, "logprobs", None) or []]

    async def routed_experts(self, item: _Item, out: RequestOutput) -> list[str | None]:
        """Per choice (index order): the SGLang payload, when R3 was asked for and the request finished
        normally. Every array passes the one fail-closed check (r3/delivery.py) first."""
        if not item.params.return_routed_experts or any(c.finish_reason in (None, "abort") for c in out.outputs):
            return [None] * len(out.outputs)
        try:
            arrays = self.ctx.delivery.checked_arrays(out)
        except R3DeliveryError as e:
            raise engine_error(f"{e}; refusing to deliver it") from e
        num_layers = self.ctx.engine.config.model_config.num_hidden_layers
        encode = [asyncio.to_thread(sglang_routed_experts, a, self.ctx.moe_layer_ids, num_layers) for a in arrays]
        return list(await asyncio.gather(*encode))

    # -- the endpoint -------------------------------------------------------------------------------

    async def generate(self, body: GenerateRequest):
        items, single = await self.items(body)
        started = time.monotonic()
        deadline = self.deadline(None)  # the server's --request-timeout-s
        if body.stream:
            if not single or items[0].params.n != 1:
                raise bad_request("stream takes one prompt with n = 1; send a batch without stream", "stream")
            item = items[0]
            first, gen = await self.start_generation(item.rid, item.prompt_token_ids, item.params, item.text, deadline)
            return StreamingResponse(self._stream(item, first, gen, started), media_type="text/event-stream")
        starts: list[tuple[RequestDelta, AsyncIterator[RequestDelta]]] = []
        try:
            for it in items:
                starts.append(await self.start_generation(it.rid, it.prompt_token_ids, it.params, it.text, deadline))
        except OpenAIError:
            for _, gen in starts:
                await gen.aclose()  # aborts the prompts of the batch that did start
            raise
        finals = await asyncio.gather(*(self.run_to_completion(first, gen) for first, gen in starts))
        results = []
        for item, final in zip(items, finals):
            payloads = await self.routed_experts(item, final)
            for c in sorted(final.outputs, key=lambda c: c.index):
                results.append(self.result(item, final, c, started, payloads[c.index]))
        return JSONResponse(results[0] if single and len(results) == 1 else results)

    async def _deltas(self, first: RequestDelta, gen: AsyncIterator[RequestDelta]) -> AsyncIterator[RequestDelta]:
        yield first
        if not first.finished:
            async for delta in self.iterate(gen):
                yield delta

    async def _stream(self, item: _Item, first: RequestDelta, gen: AsyncIterator[RequestDelta],
                      started: float) -> AsyncIterator[str]:
        """SGLang's cumulative chunks: text and output_ids so far, each step; R3 in the last one."""
        assembler = OutputAssembler(first.request_id)
        text, token_ids = "", []
        try:
            async for delta in self._deltas(first, gen):
                assembler.add(delta)
                if delta.finished:
                    break
                for c in delta.outputs:  # one choice (n = 1)
                    if not c.token_ids:
                        continue
                    text, token_ids = text + c.text, token_ids + c.token_ids
                    partial = CompletionOutput(c.index, text, list(token_ids), None,
                                               weight_versions=c.weight_versions,
                                               spans_weight_versions=c.spans_weight_versions)
                    so_far = RequestOutput(first.request_id, None, assembler.prompt_token_ids, [partial], False,
                                           num_cached_tokens=assembler.num_cached_tokens)
                    yield f"data: {json.dumps(self.result(item, so_far, partial, started, None))}\n\n"
            final = assembler.output()
            self.check_finished_ok(final)
            (payload,) = await self.routed_experts(item, final)
            yield f"data: {json.dumps(self.result(item, final, final.outputs[0], started, payload))}\n\n"
        except OpenAIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            await gen.aclose()  # aborts the request in the engine if the client went away
        yield "data: [DONE]\n\n"
