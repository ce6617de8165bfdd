"""SGLang's native `POST /generate`, the endpoint slime, miles and sglang-router sample rollouts with.

    request    text | input_ids (one prompt or a batch), sampling_params (SGLang names, protocol.py),
               rid, stream, return_logprob, top_logprobs_num, return_routed_experts,
               routed_experts_start_len, return_entropy; sglang-router's model, log_metrics, no_logs
    response   {"text", "output_ids", "meta_info"} per prompt and choice: a dict for one prompt with
               n == 1, else a list (prompt-major, then choices)
    meta_info  id, finish_reason ({"type": "stop"|"length"|"abort", ...}), prompt_tokens,
               completion_tokens, cached_tokens, e2e_latency, weight_version, weight_versions (spans
               of output tokens per version that sampled them), spans_weight_versions (tokens, KV or R3
               of more than one version: a request held in place across an update), and on request
               output_token_logprobs ([logprob, token_id, text|None] per token, the logprob a float:
               the engine's, fastdeploy_r3/logprobs.py), output_top_logprobs, output_token_entropy,
               top_p_token_ids + top_p_token_offsets (slime's custom_params.return_top_p_token_ids:
               base64 int32, token i kept ids[offsets[i]:offsets[i + 1]]; in the final answer),
               routed_experts and routed_experts_start_len

`routed_experts` is SGLang's encoding, what slime and miles decode: base64 of raw little-endian int32
`[prompt_tokens + completion_tokens - 1 - routed_experts_start_len, num_hidden_layers, K]`, every hidden
layer a row (dense layers hold the routing dtype's no-route sentinel). With the server's
--enable-return-routed-experts every answer carries it unless the request sends
return_routed_experts: false. Streaming sends SGLang's cumulative chunks (`data: {...}`: text,
output_ids and output_token_logprobs so far, every stream_interval tokens), R3 in the last one, then
`data: [DONE]`.
"""

from __future__ import annotations

import array
import asyncio
import base64
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi.responses import Response, StreamingResponse

from fastdeploy_r3.entrypoints.native.protocol import GenerateRequest, parse_sampling_params, sglang_sampling_params
from fastdeploy_r3.entrypoints.native.stream_chunks import CumulativeJson
from fastdeploy_r3.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing, bad_request, engine_error
from fastdeploy_r3.entrypoints.payload_json import SplicedJson
from fastdeploy_r3.entrypoints.pd.handoff import pd_bootstrap
from fastdeploy_r3.logprobs import MAX_LOGPROBS, TokenLogprob
from fastdeploy_r3.outputs import CompletionDelta, CompletionOutput, OutputAssembler, RequestDelta, RequestOutput
from fastdeploy_r3.r3.codec import sglang_routed_experts_b64
from fastdeploy_r3.r3.delivery import R3DeliveryError
from fastdeploy_r3.r3.layouts import to_all_layers
from fastdeploy_r3.sampling_params import InvalidRequestError, SamplingParams

# a logprob of -inf (a token masked by min_tokens, among the top alternatives) as vLLM sends it:
# JSON has no infinity
LOGPROB_FLOOR = -9999.0
# GenerateReqInput fields this server does not run; only their defaults pass, anything else is refused
_REFUSED = {
    "return_hidden_states": "hidden states are not returned by this server",
    "return_indexer_topk": "this server runs no sparse-attention indexer (DeepSeek V3.2's) to report",
    "return_bytes": "return_bytes is for image generation",
    "background": "background requests belong to the OpenAI Responses API, which this server does not serve",
    "lora_path": "this server serves no LoRA adapters",
    "image_data": "this server is text-only",
    "session_params": "this server keeps no sessions",
}


def sglang_routed_experts(moe_rows: np.ndarray, moe_layer_ids: list[int], num_hidden_layers: int) -> memoryview:
    """[R, L, K] MoE rows -> SGLang's payload as ASCII bytes: base64 of raw int32 [R, num_hidden_layers,
    K], dense layers holding the rows' dtype's sentinel (r3/layouts.to_all_layers)."""
    if list(moe_layer_ids) == list(range(num_hidden_layers)):  # every layer is MoE (Qwen3-MoE, Mixtral)
        return sglang_routed_experts_b64(moe_rows)
    return sglang_routed_experts_b64(to_all_layers(moe_rows, moe_layer_ids, num_hidden_layers))


def b64_int32(values: list[int]) -> str:
    """SGLang's encoding of an int32 array in meta_info (what slime's decode_int32_meta_array reads)."""
    return base64.b64encode(array.array("i", values).tobytes()).decode("ascii")


def _finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


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
                 return_logprob: bool, return_text_in_logprobs: bool, stream_interval: int) -> None:
        self.rid = rid
        self.prompt_token_ids = prompt_token_ids
        self.text = text
        self.params = params
        self.return_logprob = return_logprob
        self.return_text_in_logprobs = return_text_in_logprobs
        self.stream_interval = stream_interval


def _per_item(value: Any, n: int, what: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise bad_request(f"{what} has {len(value)} entries for {n} prompts; send one per prompt or one for all",
                              what)
        return value
    return [value] * n


class NativeServing(OpenAIServing):
    def check_fields(self, body: GenerateRequest) -> bool:
        """Refuse what this server does not run; return whether the request gets routed_experts."""
        if (body.text is None) == (body.input_ids is None):
            raise bad_request("send exactly one of text or input_ids")
        for name, why in _REFUSED.items():
            if getattr(body, name) not in (None, False):
                default = json.dumps(GenerateRequest.model_fields[name].default)
                raise bad_request(f"{name}={getattr(body, name)!r} is not supported: {why}; leave it out or send "
                                  f"{default}", name)
        wants_r3 = body.return_routed_experts
        if wants_r3 is None:  # not sent: the server's --enable-return-routed-experts decides
            return self.ctx.enable_return_routed_experts and self.ctx.r3_enabled
        if wants_r3 and not self.ctx.r3_enabled:
            raise bad_request("return_routed_experts is true but routing replay is off on this server; start it "
                              "with --routing-replay-config '{\"enable_routing_replay\": true}'",
                              "return_routed_experts")
        return wants_r3

    async def items(self, body: GenerateRequest) -> tuple[list[_Item], bool]:
        """The prompts of a request and whether it was a single one (answered with a dict)."""
        wants_r3 = self.check_fields(body)
        texts: list[str | None]
        if body.text is not None:
            single = isinstance(body.text, str)
            texts = [body.text] if isinstance(body.text, str) else list(body.text)
        else:
            raw = body.input_ids or []
            single = not raw or isinstance(raw[0], int)
            ids = [list(raw)] if single else [list(x) for x in raw]  # type: ignore[arg-type]
            texts = [None] * len(ids)
        n = len(texts)
        if n == 0:
            raise bad_request("the batch is empty; send at least one prompt")
        if n > self.ctx.bounds.max_batch_size:
            raise bad_request(f"the batch has {n} prompts; send at most {self.ctx.bounds.max_batch_size} per call "
                              "(--max-batch-size)", "text" if body.text is not None else "input_ids")
        if body.text is not None:
            if self.ctx.engine.tokenizer is None:
                raise bad_request("this model has no tokenizer; send input_ids", "text")
            ids = [await self.tokenize(t, "text") for t in texts]  # type: ignore[arg-type]  # bounded, off the loop
        if any(x != -1 for x in _per_item(body.logprob_start_len, n, "logprob_start_len")):
            raise bad_request("logprob_start_len: prompt logprobs are not computed by /generate; send -1",
                              "logprob_start_len")
        if body.rid is None:
            rids = [uuid.uuid4().hex for _ in range(n)]
        elif isinstance(body.rid, str):
            rids = [body.rid] if single else [f"{body.rid}_{i}" for i in range(n)]
        else:
            rids = _per_item(body.rid, n, "rid")
        sampling = _per_item(body.sampling_params, n, "sampling_params")
        logprob = _per_item(body.return_logprob, n, "return_logprob")
        top_logprobs = _per_item(body.top_logprobs_num, n, "top_logprobs_num")
        defaults = self.ctx.engine.config.model_config.generation_defaults
        items = []
        for i in range(n):
            try:
                given = parse_sampling_params(sampling[i])
                params = sglang_sampling_params(given, wants_r3, body.routed_experts_start_len, defaults,
                                                return_entropy=body.return_entropy)
                if logprob[i]:  # the engine's per-token logprobs (SGLang's definition: after temperature)
                    if not 0 <= top_logprobs[i] <= MAX_LOGPROBS:
                        raise InvalidRequestError(f"top_logprobs_num={top_logprobs[i]}; use a value in "
                                                  f"[0, {MAX_LOGPROBS}]")
                    params = dataclasses.replace(params, logprobs=top_logprobs[i])
                self.ctx.bounds.check(params, self.ctx.engine.config.model_config.vocab_size)
            except InvalidRequestError as e:
                raise bad_request(str(e), "sampling_params") from e
            items.append(_Item(rids[i], ids[i], texts[i], params, bool(logprob[i]), body.return_text_in_logprobs,
                               given.stream_interval or 1))
        choices = sum(it.params.n for it in items)
        if choices > self.ctx.bounds.max_batch_size:
            raise bad_request(f"the call asks for {choices} choices (prompts x n); send at most "
                              f"{self.ctx.bounds.max_batch_size} per call (--max-batch-size)", "sampling_params")
        return items, single

    # -- answers ------------------------------------------------------------------------------------

    def result(self, item: _Item, out: RequestOutput, c: CompletionOutput, started: float,
               routed_experts: str | None) -> dict[str, Any]:
        records = c.logprobs or []
        lists: dict[str, Any] = {"text": c.text, "output_ids": list(c.token_ids)}
        if item.return_logprob:
            lists["output_token_logprobs"] = self._output_token_logprobs(c, item.return_text_in_logprobs)
            if item.params.logprobs:
                lists["output_top_logprobs"] = self._output_top_logprobs(records, item.return_text_in_logprobs)
        if item.params.return_entropy:
            lists["output_token_entropy"] = [r.entropy for r in records]
        return self.answer(item, len(out.outputs), len(out.prompt_token_ids), out.num_cached_tokens, c,
                           len(c.token_ids), started, lists, routed_experts)

    def answer(self, item: _Item, num_choices: int, prompt_tokens: int, cached_tokens: int,
               c: CompletionOutput | CompletionDelta, num_tokens: int, started: float, lists: dict[str, Any],
               routed_experts: str | None) -> dict[str, Any]:
        """One choice's answer (or stream chunk): c gives its state (finish, versions, spans; its token
        list only once finished), `lists` the cumulative fields (values, or placeholders of their JSON
        while streaming: stream_chunks.py), in the order SGLang writes them."""
        spans = [{"version": s.version, "start": s.start, "end": s.end} for s in c.weight_versions]
        meta: dict[str, Any] = {
            "id": item.rid if num_choices == 1 else f"{item.rid}#{c.index}",
            "finish_reason": finish_reason(c),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": num_tokens,
            "cached_tokens": cached_tokens,
            "e2e_latency": time.monotonic() - started,
            "weight_version": spans[-1]["version"] if spans else None,
            "weight_versions": spans,
            "spans_weight_versions": c.spans_weight_versions,
        }
        if c.spec is not None:  # SGLang's names; accept length = completion tokens per verify
            meta.update(spec_verify_ct=c.spec.verify_ct, spec_draft_token_num=c.spec.draft_tokens,
                        spec_accept_token_num=c.spec.accepted_tokens,
                        spec_accept_rate=c.spec.accepted_tokens / c.spec.draft_tokens if c.spec.draft_tokens else 0.0,
                        spec_accept_length=num_tokens / c.spec.verify_ct)
        for name in ("output_token_logprobs", "output_top_logprobs", "output_token_entropy"):
            if name in lists:
                meta[name] = lists[name]
        if item.params.return_top_p_token_ids and c.finish_reason is not None:
            kept: list[int] = []
            offsets = [0]
            for r in c.logprobs or []:
                kept.extend(r.kept_ids or [])
                offsets.append(len(kept))
            meta["top_p_token_ids"], meta["top_p_token_offsets"] = b64_int32(kept), b64_int32(offsets)
        if routed_experts is not None:
            meta["routed_experts"] = routed_experts
            meta["routed_experts_start_len"] = item.params.routed_experts_start
        return {"text": lists["text"], "output_ids": lists["output_ids"], "meta_info": meta}

    def _token_text(self, token_id: int, wanted: bool) -> str | None:
        tokenizer = self.ctx.engine.tokenizer
        return tokenizer.decode([token_id], skip_special_tokens=False) if wanted and tokenizer is not None else None

    def _output_token_logprobs(self, c: CompletionOutput, with_text: bool) -> list[list[Any]]:
        """[logprob, token_id, text] per output token (text only with return_text_in_logprobs). Every
        token has its float: the engine sends one record per token of a request that asked."""
        records = c.logprobs or []
        if len(records) != len(c.token_ids):
            raise engine_error(f"the engine sent {len(records)} logprobs for {len(c.token_ids)} tokens")
        return [self._logprob_entry(t, r, with_text) for r, t in zip(records, c.token_ids)]

    def _logprob_entry(self, token_id: int, r: TokenLogprob, with_text: bool) -> list[Any]:
        return [_finite(r.logprob), token_id, self._token_text(token_id, with_text)]

    def _output_top_logprobs(self, records: list[TokenLogprob], with_text: bool) -> list[list[list[Any]]]:
        """SGLang's output_top_logprobs: per output token, [logprob, token_id, text] of the N most likely."""
        return [self._top_entries(r, with_text) for r in records]

    def _top_entries(self, r: TokenLogprob, with_text: bool) -> list[list[Any]]:
        return [[_finite(lp), tid, self._token_text(tid, with_text)] for tid, lp in r.top]

    def cumulative_json(self, item: _Item) -> CumulativeJson:
        """The JSON of a stream's cumulative fields, grown delta by delta (stream_chunks.py)."""
        with_text = item.return_text_in_logprobs
        entry = (lambda t, r: self._logprob_entry(t, r, with_text)) if item.return_logprob else None
        tops = (lambda r: self._top_entries(r, with_text)) if item.return_logprob and item.params.logprobs else None
        return CumulativeJson(entry, tops, item.params.return_entropy)

    async def routed_experts(self, item: _Item, out: RequestOutput) -> list[memoryview | None]:
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

    def count(self, body: GenerateRequest) -> None:
        if body.log_metrics:  # SGLang's health probes send false to stay out of the numbers
            self.ctx.counters.generate_requests += 1

    # -- the endpoint -------------------------------------------------------------------------------

    async def generate(self, body: GenerateRequest):
        items, single = await self.items(body)
        started = time.monotonic()
        deadline = self.deadline(None)  # the server's --request-timeout-s
        boot = pd_bootstrap(body.bootstrap_host, body.bootstrap_port, body.bootstrap_room, single)
        if body.stream:
            if not single or items[0].params.n != 1:
                raise bad_request("stream takes one prompt with n = 1; send a batch without stream", "stream")
            item = items[0]
            first, gen = await self.start_generation(item.rid, item.prompt_token_ids, item.params, item.text, deadline,
                                                     boot=boot)
            return StreamingResponse(self._stream(body, item, first, gen, started), media_type="text/event-stream")
        starts: list[tuple[RequestDelta, AsyncIterator[RequestDelta]]] = []
        try:
            for it in items:
                starts.append(await self.start_generation(it.rid, it.prompt_token_ids, it.params, it.text, deadline,
                                                          boot=boot))
        except OpenAIError:
            for _, gen in starts:
                await gen.aclose()  # aborts the prompts of the batch that did start
            raise
        finals = await asyncio.gather(*(self.run_to_completion(first, gen) for first, gen in starts))
        results = []
        spliced = SplicedJson()  # the R3 payloads are not scanned by json.dumps (payload_json.py)
        for item, final in zip(items, finals):
            payloads = await self.routed_experts(item, final)
            for c in sorted(final.outputs, key=lambda c: c.index):
                p = payloads[c.index]
                results.append(self.result(item, final, c, started, None if p is None else spliced.hold(p)))
        self.count(body)
        # rendered as JSONResponse renders (compact, UTF-8, no NaN)
        body = spliced.dumps_bytes(results[0] if single and len(results) == 1 else results, ensure_ascii=False,
                                   allow_nan=False, separators=(",", ":"))
        return Response(body, media_type="application/json")

    async def _deltas(self, first: RequestDelta, gen: AsyncIterator[RequestDelta]) -> AsyncIterator[RequestDelta]:
        yield first
        if not first.finished:
            async for delta in self.iterate(gen):
                yield delta

    async def _stream(self, body: GenerateRequest, item: _Item, first: RequestDelta,
                      gen: AsyncIterator[RequestDelta], started: float) -> AsyncIterator[str | bytes]:
        """SGLang's cumulative chunks: text, output_ids and logprobs so far, every stream_interval new
        tokens; the last one is the whole answer (R3 included). A chunk is skipped while the request's
        next delta is already waiting here: the next chunk holds all of it, so a client (or this
        process) that falls behind the engine gets fewer, larger chunks instead of a growing backlog
        of chunks that each repeat everything so far. The repeated lists are encoded once per delta,
        not once per chunk (stream_chunks.py)."""
        assembler = OutputAssembler(first.request_id)
        so_far = self.cumulative_json(item)
        sent = 0
        try:
            async for delta in self._deltas(first, gen):
                assembler.add(delta)
                for c in delta.outputs:  # one choice (n = 1)
                    so_far.add(c, engine_error)
                if delta.finished:
                    break
                if self.ctx.engine.queued(delta.request_id):
                    continue
                if so_far.last is None or so_far.num_tokens - sent < item.stream_interval:
                    continue
                sent = so_far.num_tokens
                spliced = SplicedJson()
                chunk = self.answer(item, 1, len(assembler.prompt_token_ids), assembler.num_cached_tokens,
                                    so_far.last, so_far.num_tokens, started, so_far.fields(spliced), None)
                yield spliced.dumps_bytes(chunk, prefix="data: ", suffix="\n\n", allow_nan=False)
            final = assembler.output()
            self.check_finished_ok(final)
            (payload,) = await self.routed_experts(item, final)
            spliced = SplicedJson()  # the R3 payload is not scanned by json.dumps (payload_json.py)
            answer = self.result(item, final, final.outputs[0], started,
                                 None if payload is None else spliced.hold(payload))
            self.count(body)
            yield spliced.dumps_bytes(answer, prefix="data: ", suffix="\n\n", allow_nan=False)
        except OpenAIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            await gen.aclose()  # aborts the request in the engine if the client went away
        yield "data: [DONE]\n\n"
