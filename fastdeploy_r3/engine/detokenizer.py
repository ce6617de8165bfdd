"""Incremental detokenisation: the text that one more token adds, decoding only a short window.

Decoding the whole output again at every step costs O(N) per step (O(N^2) per request). Here each
step decodes only the tokens since the last point where the text was known to end cleanly:

    token_ids:  [ ......... emitted ......... | context | held back ]
                                              ^prefix   ^read       ^len
    prefix_text = decode(ids[prefix:read])   (already emitted)
    window_text = decode(ids[prefix:])
    new text    = window_text[len(prefix_text):], emitted only when it does not end in U+FFFD

A multi-byte UTF-8 character whose bytes are split over several byte-level tokens decodes to
"\ufffd" until its last byte arrives; that tail is held back instead of being emitted as "\ufffd"
and then contradicted. Decoding from `prefix` (one emitted chunk back) rather than from `read` lets
tokenizers whose decode depends on the previous token (leading-space markers) see their context.

Only `tokenizer.decode(ids) -> str` is needed.
"""

from __future__ import annotations

from typing import Protocol

from fastdeploy_r3.outputs import RequestDelta, TextRule
from fastdeploy_r3.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"

# A UTF-8 character has at most 4 bytes, so a byte-level tokenizer completes it within 4 tokens.
# Past that the tail is garbage that no later token can repair, and it is emitted as it decodes
# (so that a stream of invalid bytes costs O(window), not O(N), per step).
MAX_HELD_TOKENS = 4


class Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    """One request's output tokens -> text deltas. `push` per step, `flush` once at the end."""

    def __init__(self, tokenizer: Decoder) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # tokens before this are emitted as text

    def push(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly "", when a character is incomplete)."""
        self.token_ids.extend(new_token_ids)
        held = len(self.token_ids) - self.read_offset
        return self._advance(allow_incomplete=held > MAX_HELD_TOKENS)

    def flush(self) -> str:
        """Return everything still held back (the request finished; an incomplete tail stays "\ufffd")."""
        return self._advance(allow_incomplete=True)

    def _advance(self, allow_incomplete: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self.prefix_offset : self.read_offset])
        window_text = decode(self.token_ids[self.prefix_offset :])
        if window_text == prefix_text:
            # e.g. special tokens that decode to nothing: move the window on, nothing to say
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return ""
        if len(window_text) < len(prefix_text):
            return ""
        if window_text.endswith(REPLACEMENT_CHAR) and not allow_incomplete:
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return window_text[len(prefix_text) :]


class Decoding:
    """The tokenizer's decode with a request's skip_special_tokens and spaces_between_special_tokens."""

    def __init__(self, tokenizer: object, skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.kwargs = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:  # the default needs no keyword: any decode(ids, skip_...) works
            self.kwargs["spaces_between_special_tokens"] = False

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, **self.kwargs)  # type: ignore[attr-defined]


class DeltaDetokenizer:
    """The receiver's half of detokenization (the API server, off the engine loop): fills in the text
    of one request's deltas whose engine left it (TextRule, outputs.py), token by token as
    engine/token_processor.py would have, so the text is the same to the character."""

    def __init__(self, tokenizer: object, params: SamplingParams) -> None:
        self._decoding = Decoding(tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens)
        self._choices: dict[int, IncrementalDetokenizer] = {}

    def fill(self, delta: RequestDelta) -> RequestDelta:
        for c in delta.outputs:
            rule = c.text_rule
            if rule is TextRule.IN_TEXT:
                continue
            detok = self._choices.get(c.index)
            if detok is None:
                detok = self._choices[c.index] = IncrementalDetokenizer(self._decoding)
            ids = c.token_ids[:-1] if rule is TextRule.PUSH_BUT_LAST_FLUSH else c.token_ids
            parts = [detok.push([token_id]) for token_id in ids]  # one by one: the engine's windows
            if rule is not TextRule.PUSH:
                parts.append(detok.flush())
            c.text, c.text_rule = "".join(parts), TextRule.IN_TEXT
        return delta
