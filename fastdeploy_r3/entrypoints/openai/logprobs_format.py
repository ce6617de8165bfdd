"""The engine's TokenLogprob records in OpenAI's two response shapes.

    chat          choice.logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}
                  top_logprobs holds exactly the N most likely tokens (N = request.top_logprobs)
    completions   choice.logprobs = {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
                  top_logprobs[i] maps token text -> logprob for the N most likely tokens plus the
                  chosen one (so N or N + 1 entries, as vLLM does); with echo the prompt comes first
                  and its entry 0 is None (nothing predicts the first token)

Token text is each id decoded alone with special tokens kept ("token_id:<id>", vLLM's spelling, when
the model has no tokenizer). A logprob of -inf (a token masked by
min_tokens) is sent as -9999.0, as vLLM does, because JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from fastdeploy_r3.logprobs import TokenLogprob

_FLOOR = -9999.0


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatTopLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(_Model):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(_Model):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


def _finite(x: float) -> float:
    return x if math.isfinite(x) else _FLOOR


class LogprobFormatter:
    """Per request: token id -> text (cached) and the two OpenAI shapes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._text[token_id] = text
        return text

    def _top(self, token_id: int, logprob: float) -> ChatTopLogprob:
        text = self.token_text(token_id)
        return ChatTopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode("utf-8")))

    def chat(self, records: Sequence[TokenLogprob]) -> ChatLogprobs:
        content = []
        for r in records:
            chosen = self._top(r.token_id, r.logprob)
            content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=[self._top(t, lp) for t, lp in r.top]))
        return ChatLogprobs(content=content)

    def completion(
        self, token_ids: Sequence[int], records: Sequence[TokenLogprob | None], text_offset: int = 0
    ) -> CompletionLogprobs:
        """token_ids[i] with records[i] (None: no logprob, the echoed first prompt token); offsets
        count characters of the token texts from text_offset."""
        out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        offset = text_offset
        for tok, r in zip(token_ids, records, strict=True):
            text = self.token_text(tok)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if r is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_finite(r.logprob))
            top = {self.token_text(t): _finite(lp) for t, lp in r.top}
            top.setdefault(text, _finite(r.logprob))
            out.top_logprobs.append(top)
        return out
