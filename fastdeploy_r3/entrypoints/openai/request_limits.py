"""Bounds the API server puts on a request before it costs anything (issue 11, F2).

    body      BodySizeLimit: Content-Length over --max-request-body-mb is answered 413 before a byte
              of the body is read; a body without Content-Length (chunked) is cut off at the bound
    prompt    PromptCharBound: a prompt of more characters than max_model_len tokens could cover is
              refused (400) before tokenization, which is the expensive part of a huge prompt
    tokenize  the server runs the tokenizer in a worker thread (asyncio.to_thread), never on the loop
    choices   n <= --max-n per prompt, and a /generate call's prompts x n <= --max-batch-size: one
              request's answer (tokens, logprobs, R3 for every choice) stays bounded in memory

The character bound is exact, not a guess: a token covers at most `longest_token_chars` characters
of text (its longest vocabulary entry; byte-level BPE spells each byte as one character, so the
entry is at least as long as the text it stands for), so a prompt of more than
`max_model_len * longest_token_chars` characters needs more than max_model_len tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fastdeploy_r3.sampling_params import InvalidRequestError, SamplingParams

# When the tokenizer does not list its vocabulary: generous enough for every vocabulary we know of
# (runs of spaces or of '=' are the longest entries, well under this), so no prompt that fits is refused.
FALLBACK_LONGEST_TOKEN_CHARS = 256


@dataclass(frozen=True)
class RequestBounds:
    """The choices a request may ask for: n per prompt (--max-n) and prompts x n of one /generate call
    (--max-batch-size), so that one answer (tokens, logprobs, R3 of every choice) stays bounded."""

    max_n: int = 64
    max_batch_size: int = 256

    def check(self, params: SamplingParams, vocab_size: int) -> None:
        """What depends on the model and these bounds (SamplingParams checks the rest)."""
        params.check_vocab(vocab_size)
        if params.n > self.max_n:
            raise InvalidRequestError(f"n={params.n}; this server serves at most {self.max_n} choices per prompt "
                                      "(--max-n)")


class BodySizeLimit:
    """ASGI middleware: HTTP request bodies larger than `max_bytes` are refused with 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        mib = self.max_bytes / 2**20
        return (f"the request body is larger than {mib:g} MiB; send a shorter prompt, or start the "
                "server with a larger --max-request-body-mb")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    await self._refuse(send)
                    return
        received = 0

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # raised inside the endpoint's body read; the app's handler answers 413
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, bounded_receive, send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"error": {"message": self._message(), "type": "invalid_request_error",
                                     "param": None, "code": 413}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def longest_token_chars(tokenizer: Any) -> int:
    """Characters in the tokenizer's longest vocabulary entry (a bound on what one token covers)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return FALLBACK_LONGEST_TOKEN_CHARS
    vocab = get_vocab()
    return max((len(tok) for tok in vocab), default=FALLBACK_LONGEST_TOKEN_CHARS)


class PromptCharBound:
    """Refuses prompt text that cannot fit in max_model_len tokens, before tokenizing it."""

    def __init__(self, max_model_len: int, longest_token_chars: int) -> None:
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * max(1, longest_token_chars)

    def check(self, num_chars: int) -> str | None:
        """None when a text of `num_chars` characters may fit; else the message to answer with."""
        if num_chars <= self.max_chars:
            return None
        return (f"the prompt has {num_chars} characters, more than the {self.max_model_len} tokens of "
                f"max_model_len can hold (at most {self.max_chars} characters); shorten the prompt")
