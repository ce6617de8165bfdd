"""/v1/completions, streaming and not."""

from __future__ import annotations

from fastapi.responses import JSONResponse, StreamingResponse

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
    stream_events,
)
from fastdeploy_r3.outputs import RequestDelta, RequestOutput

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIServingCompletion(OpenAIServing):
    def prompt_token_ids(self, request: CompletionRequest) -> tuple[list[int], str | None]:
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request("batched prompts are not supported; send one prompt per request", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.ctx.engine.tokenizer.encode(prompt), prompt
        return list(prompt), None  # the engine checks length and vocabulary

    async def create_completion(self, request: CompletionRequest):
        self.check_model(request.model)
        request_id = self.new_request_id("cmpl")
        rollout_id = self.check_r3_request(request.return_routed_experts, request.rollout_id, request.user, request_id)
        prompt_token_ids, prompt = self.prompt_token_ids(request)
        params = self.sampling_params(request, DEFAULT_COMPLETION_MAX_TOKENS)
        first, gen = await self.start_generation(request_id, prompt_token_ids, params, prompt)
        model = self.ctx.served_model_name
        moe_layer_ids = self.response_moe_layer_ids(params)

        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)

            def delta_chunks(delta: RequestDelta, streamed: set[int]) -> list[dict]:
                chunks = []
                for c in delta.outputs:
                    streamed.add(c.index)
                    if c.text:
                        choice = CompletionChoice(index=c.index, text=c.text)
                        chunks.append(CompletionStreamResponse(id=request_id, model=model, choices=[choice]))
                return [ch.model_dump(exclude_none=True) for ch in chunks]

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
                    )
                    chunks.append(
                        CompletionStreamResponse(
                            id=request_id, model=model, choices=[choice], moe_layer_ids=moe_layer_ids
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

        final = await self.run_to_completion(first, gen)
        r3 = await self.deliver_r3(final, params, rollout_id)
        choices = [
            CompletionChoice(
                index=c.index,
                text=c.text,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                routed_experts=r3.payloads[c.index],
                routed_experts_start=r3.starts[c.index],
            )
            for c in sorted(final.outputs, key=lambda c: c.index)
        ]
        body = CompletionResponse(
            id=request_id, model=model, choices=choices, usage=self.usage(final), moe_layer_ids=moe_layer_ids
        )
        return JSONResponse(body.model_dump())
