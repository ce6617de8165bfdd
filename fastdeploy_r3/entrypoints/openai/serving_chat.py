"""/v1/chat/completions, streaming and not."""

from __future__ import annotations

import asyncio

from fastapi.responses import StreamingResponse

from fastdeploy_r3.config import ConfigError
from fastdeploy_r3.entrypoints.openai.logprobs_format import LogprobFormatter
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
    choice_versions,
    response_extras,
    stream_events,
)
from fastdeploy_r3.entrypoints.payload_json import json_answer
from fastdeploy_r3.entrypoints.pd.handoff import pd_bootstrap
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
    async def prompt(self, request: ChatCompletionRequest) -> tuple[list[int], str]:
        tokenizer = self.ctx.engine.tokenizer
        messages = _message_dicts(request)
        # the template only adds to the messages: refuse what cannot fit before rendering it
        message = self.ctx.prompt_bound.check(sum(len(m["content"]) for m in messages))
        if message is not None:
            raise bad_request(message, "messages")
        try:
            text = await asyncio.to_thread(tokenizer.apply_chat_template, messages, tools=request.tools)
        except ConfigError as e:
            raise bad_request(str(e), "messages") from e
        # the rendered template holds its own special tokens (vLLM encodes chat prompts the same way)
        return await self.tokenize(text, "messages", add_special_tokens=False), text

    async def create_chat_completion(self, request: ChatCompletionRequest):
        self.check_model(request.model)
        deadline = self.deadline(request.timeout)
        request_id = self.new_request_id("chatcmpl")
        rollout_id = self.check_r3_request(request.return_routed_experts, request.rollout_id, request.user, request_id)
        prompt_token_ids, prompt = await self.prompt(request)
        # chat default: whatever room the context leaves (the engine's limit, which follows its KV cache);
        # at least 1, so that a prompt with no room gets the engine's "prompt too long" error
        default_max_tokens = max(1, self.ctx.engine.info.max_model_len - len(prompt_token_ids))
        params = self.sampling_params(request, default_max_tokens)
        boot = pd_bootstrap(request.bootstrap_host, request.bootstrap_port, request.bootstrap_room)
        release = await self.claim_rollout(request_id, rollout_id, params, request.overwrite_rollout,
                                           request.timeout)
        first, gen = await self.start_generation(request_id, prompt_token_ids, params, prompt, deadline, release, boot)
        model = self.ctx.served_model_name
        moe_layer_ids = self.response_moe_layer_ids(params)
        fmt = LogprobFormatter(self.ctx.engine.tokenizer) if params.logprobs is not None else None
        ids = request.return_token_ids

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
                        # return_token_ids: the prompt's ids ride on each choice's first chunk
                        chunks.append(chunk([role], prompt_token_ids=prompt_token_ids if ids else None))
                    if c.text or ((ids or fmt is not None) and c.token_ids):
                        choice = ChatCompletionStreamChoice(
                            index=c.index,
                            delta=DeltaMessage(content=c.text),
                            logprobs=fmt.chat(c.logprobs) if fmt is not None and c.logprobs is not None else None,
                            token_ids=c.token_ids if ids else None,
                        )
                        chunks.append(chunk([choice]))
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
                                **choice_versions(c),
                            )
                        ],
                        moe_layer_ids=moe_layer_ids,
                        **response_extras(out, r3),
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

        final, r3 = await self.finish_and_deliver(first, gen, params, rollout_id)
        choices = [
            ChatCompletionChoice(
                index=c.index,
                message=ChatMessageOut(content=c.text),
                logprobs=fmt.chat(c.logprobs) if fmt is not None and c.logprobs is not None else None,
                token_ids=c.token_ids if ids else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                routed_experts=r3.payloads[c.index],
                routed_experts_start=r3.starts[c.index],
                **choice_versions(c),
            )
            for c in sorted(final.outputs, key=lambda c: c.index)
        ]
        body = ChatCompletionResponse(
            id=request_id, model=model, choices=choices, usage=self.usage(final), moe_layer_ids=moe_layer_ids,
            prompt_token_ids=prompt_token_ids if ids else None,
            **response_extras(final, r3),
        )
        return json_answer(body.model_dump())  # R3 payloads spliced, not scanned
