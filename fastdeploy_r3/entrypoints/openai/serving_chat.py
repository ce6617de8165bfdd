"""/v1/chat/completions, streaming and not."""

from __future__ import annotations

from fastapi.responses import JSONResponse, StreamingResponse

from fastdeploy_r3.config import ConfigError
from fastdeploy_r3.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    DeltaMessage,
)
from fastdeploy_r3.entrypoints.openai.serving_engine import (
    OpenAIServing,
    R3Result,
    bad_request,
    stream_events,
)
from fastdeploy_r3.outputs import RequestDelta, RequestOutput


def _message_dicts(request: ChatCompletionRequest) -> list[dict]:
    messages = []
    for m in request.messages:
        content = m.content
        if isinstance(content, list):
            # OpenAI content parts: only text parts can be served by a text model
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise bad_request(
                        f"content part of type {part.get('type')!r} is not supported; use text", "messages"
                    )
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        messages.append({"role": m.role, "content": content or ""})
    return messages


class OpenAIServingChat(OpenAIServing):
    def prompt(self, request: ChatCompletionRequest) -> tuple[list[int], str]:
        tokenizer = self.ctx.engine.tokenizer
        try:
            text = tokenizer.apply_chat_template(_message_dicts(request))
        except ConfigError as e:
            raise bad_request(str(e), "messages") from e
        return tokenizer.encode(text), text

    async def create_chat_completion(self, request: ChatCompletionRequest):
        self.check_model(request.model)
        request_id = self.new_request_id("chatcmpl")
        rollout_id = self.check_r3_request(request.return_routed_experts, request.rollout_id, request.user, request_id)
        prompt_token_ids, prompt = self.prompt(request)
        # chat default: whatever room the context leaves (the engine's limit, which follows its KV cache);
        # at least 1, so that a prompt with no room gets the engine's "prompt too long" error
        default_max_tokens = max(1, self.ctx.engine.info.max_model_len - len(prompt_token_ids))
        params = self.sampling_params(request, default_max_tokens)
        first, gen = await self.start_generation(request_id, prompt_token_ids, params, prompt)
        model = self.ctx.served_model_name
        moe_layer_ids = self.response_moe_layer_ids(params)

        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)

            def chunk(choices: list[ChatCompletionStreamChoice], **kw) -> dict:
                resp = ChatCompletionStreamResponse(id=request_id, model=model, choices=choices, **kw)
                return resp.model_dump(exclude_none=True)

            def delta_chunks(delta: RequestDelta, streamed: set[int]) -> list[dict]:
                chunks = []
                for c in delta.outputs:
                    if c.index not in streamed:  # first chunk of a choice announces the role
                        streamed.add(c.index)
                        role = ChatCompletionStreamChoice(
                            index=c.index, delta=DeltaMessage(role="assistant", content="")
                        )
                        chunks.append(chunk([role]))
                    if c.text:
                        chunks.append(
                            chunk([ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(content=c.text))])
                        )
                return chunks

            def final_chunks(out: RequestOutput, r3: R3Result) -> list[dict]:
                return [
                    chunk(
                        [
                            ChatCompletionStreamChoice(
                                index=c.index,
                                delta=DeltaMessage(),
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                                routed_experts=r3.payloads[c.index],
                                routed_experts_start=r3.starts[c.index],
                            )
                        ],
                        moe_layer_ids=moe_layer_ids,
                    )
                    for c in sorted(out.outputs, key=lambda c: c.index)
                ]

            def usage_chunk(out: RequestOutput) -> dict:
                return chunk([], usage=self.usage(out))

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
            ChatCompletionChoice(
                index=c.index,
                message=ChatMessageOut(content=c.text),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                routed_experts=r3.payloads[c.index],
                routed_experts_start=r3.starts[c.index],
            )
            for c in sorted(final.outputs, key=lambda c: c.index)
        ]
        body = ChatCompletionResponse(
            id=request_id, model=model, choices=choices, usage=self.usage(final), moe_layer_ids=moe_layer_ids
        )
        return JSONResponse(body.model_dump())
