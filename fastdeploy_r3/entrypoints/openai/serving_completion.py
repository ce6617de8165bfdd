"""/v1/completions, streaming and not."""

from __future__ import annotations

from fastapi.responses import StreamingResponse

from fastdeploy_r3.entrypoints.openai.logprobs_format import CompletionLogprobs, LogprobFormatter
from fastdeploy_r3.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from fastdeploy_r3.entrypoints.openai.serving_engine import (
    OpenAIServing,
    R3Result,
    bad_request,
    choice_versions,
    response_extras,
    stream_events,
)
from fastdeploy_r3.entrypoints.payload_json import json_answer
from fastdeploy_r3.entrypoints.pd.handoff import pd_bootstrap
from fastdeploy_r3.outputs import CompletionOutput, RequestDelta, RequestOutput

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIServingCompletion(OpenAIServing):
    async def prompt_token_ids(self, request: CompletionRequest) -> tuple[list[int], str | None]:
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request("batched prompts are not supported; send one prompt per request", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await self.tokenize(prompt, "prompt"), prompt
        return list(prompt), None  # the engine checks length and vocabulary

    def echo_text(self, prompt: str | None, prompt_token_ids: list[int]) -> str:
        if prompt is not None:
            return prompt
        tokenizer = self.ctx.engine.tokenizer
        return tokenizer.decode(prompt_token_ids) if tokenizer is not None else ""

    @staticmethod
    def choice_logprobs(fmt: LogprobFormatter | None, out: RequestOutput, c: CompletionOutput,
                        echo: bool) -> CompletionLogprobs | None:
        """OpenAI completion logprobs of one finished choice (with echo: the prompt's first)."""
        if fmt is None or c.logprobs is None:
            return None
        ids, records = list(c.token_ids), list(c.logprobs)
        if echo:
            assert out.prompt_logprobs is not None, "echo with logprobs asks the engine for prompt logprobs"
            ids, records = out.prompt_token_ids + ids, list(out.prompt_logprobs) + records
        return fmt.completion(ids, records)

    async def create_completion(self, request: CompletionRequest):
        self.check_model(request.model)
        deadline = self.deadline(request.timeout)
        request_id = self.new_request_id("cmpl")
        rollout_id = self.check_r3_request(request.return_routed_experts, request.rollout_id, request.user, request_id)
        prompt_token_ids, prompt = await self.prompt_token_ids(request)
        params = self.sampling_params(request, DEFAULT_COMPLETION_MAX_TOKENS)
        boot = pd_bootstrap(request.bootstrap_host, request.bootstrap_port, request.bootstrap_room)
        release = await self.claim_rollout(request_id, rollout_id, params, request.overwrite_rollout,
                                           request.timeout)
        first, gen = await self.start_generation(request_id, prompt_token_ids, params, prompt, deadline, release, boot)
        model = self.ctx.served_model_name
        moe_layer_ids = self.response_moe_layer_ids(params)
        fmt = LogprobFormatter(self.ctx.engine.tokenizer) if params.logprobs is not None else None

        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)

            extras = request.return_token_ids or fmt is not None
            offsets: dict[int, int] = {}  # per choice: characters streamed so far (logprobs text_offset)
            state = {"echo_pending": request.echo, "first_chunk": True}

            def response(choices: list[CompletionChoice], **kw) -> dict:
                if state["first_chunk"] and request.return_token_ids:
                    kw["prompt_token_ids"] = prompt_token_ids
                state["first_chunk"] = False
                return CompletionStreamResponse(id=request_id, model=model, choices=choices,
                                                **kw).model_dump(exclude_none=True)

            def echo_chunks(delta: RequestDelta) -> list[dict]:
                """The prompt (and its logprobs, once the engine scored it), first, once per choice."""
                if not state["echo_pending"] or (params.prompt_logprobs is not None and delta.prompt_logprobs is None):
                    return []
                state["echo_pending"] = False
                text = self.echo_text(prompt, prompt_token_ids)
                lp = None
                if fmt is not None and delta.prompt_logprobs is not None:
                    lp = fmt.completion(prompt_token_ids, delta.prompt_logprobs)
                chunks = []
                for i in range(params.n):
                    offsets[i] = len(text)
                    chunks.append(response([CompletionChoice(index=i, text=text, logprobs=lp)]))
                return chunks

            def delta_chunks(delta: RequestDelta, streamed: set[int]) -> list[dict]:
                chunks = echo_chunks(delta)
                for c in delta.outputs:
                    streamed.add(c.index)
                    if c.text or (extras and c.token_ids):
                        lp = None
                        if fmt is not None and c.logprobs is not None:
                            lp = fmt.completion(c.token_ids, c.logprobs, offsets.get(c.index, 0))
                            offsets[c.index] = offsets.get(c.index, 0) + sum(len(t) for t in lp.tokens)
                        choice = CompletionChoice(index=c.index, text=c.text, logprobs=lp,
                                                  token_ids=c.token_ids if request.return_token_ids else None)
                        chunks.append(response([choice]))
                return chunks

            def final_chunks(out: RequestOutput, r3: R3Result) -> list[dict]:
                chunks = []
                for c in sorted(out.outputs, key=lambda c: c.index):
                    choice = CompletionChoice(
                        index=c.index,
                        text="",
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        routed_experts=r3.payloads[c.index],
                        routed_experts_start=r3.starts[c.index],
                        **choice_versions(c),
                    )
                    chunks.append(
                        CompletionStreamResponse(
                            id=request_id, model=model, choices=[choice], moe_layer_ids=moe_layer_ids,
                            **response_extras(out, r3),
                        )
                    )
                return [ch.model_dump(exclude_none=True) for ch in chunks]

            def usage_chunk(out: RequestOutput) -> dict:
                return CompletionStreamResponse(
                    id=request_id, model=model, choices=[], usage=self.usage(out)
                ).model_dump(exclude_none=True)

            return StreamingResponse(
                stream_events(
                    self,
                    first,
                    gen,
                    params,
                    rollout_id,
                    delta_chunks,
                    final_chunks,
                    usage_chunk if include_usage else None,
                ),
                media_type="text/event-stream",
            )

        final, r3 = await self.finish_and_deliver(first, gen, params, rollout_id)
        echo = self.echo_text(prompt, prompt_token_ids) if request.echo else ""
        ids = request.return_token_ids
        choices = [
            CompletionChoice(
                index=c.index,
                text=echo + c.text,
                logprobs=self.choice_logprobs(fmt, final, c, request.echo),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                routed_experts=r3.payloads[c.index],
                routed_experts_start=r3.starts[c.index],
                token_ids=c.token_ids if ids else None,
                prompt_token_ids=prompt_token_ids if ids else None,
                **choice_versions(c),
            )
            for c in sorted(final.outputs, key=lambda c: c.index)
        ]
        body = CompletionResponse(
            id=request_id, model=model, choices=choices, usage=self.usage(final), moe_layer_ids=moe_layer_ids,
            prompt_token_ids=prompt_token_ids if ids else None,
            **response_extras(final, r3),
        )
        return json_answer(body.model_dump())  # R3 payloads spliced, not scanned
