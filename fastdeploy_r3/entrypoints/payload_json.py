"""JSON answers carrying large base64 payloads (R3's routed_experts: ~1.5 MB a request for a 30B MoE
at 768 tokens), serialised without json.dumps scanning the payload character by character.

Base64 text (A-Z a-z 0-9 + / =) needs no JSON escaping, so the answer is serialised with a
placeholder where each payload goes and the payloads are spliced in after: the same bytes json.dumps
would write, at a memcpy's cost instead of the encoder's scan (~5 ms a request on the CPU, measured by
tools/profile_output_path.py --r3-payload). A placeholder holds a per-process random nonce, so no
text a client or the model wrote can be taken for one. hold_raw() splices JSON text the same way in
place of a value (the cumulative lists of a /generate stream chunk: native/stream_chunks.py).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from fastapi.responses import Response

_NONCE = secrets.token_hex(16)


class SplicedJson:
    """Collects payloads while an answer is built; dumps() serialises the answer with them in place
    (as text), dumps_bytes() as bytes with the payloads' own buffers joined in once."""

    def __init__(self) -> None:
        self._payloads: list[str | bytes | memoryview] = []
        self._raw: list[bool] = []  # whether payload i is JSON text that replaces its quoted placeholder

    def hold(self, payload: str | bytes | memoryview) -> str:
        """The placeholder to put in the answer where `payload` (base64 only, as text or ASCII bytes) goes."""
        self._payloads.append(payload)
        self._raw.append(False)
        return self._placeholder(len(self._payloads) - 1)

    def hold_raw(self, json_text: str) -> str:
        """The placeholder to put in the answer where the value `json_text` (valid JSON, as the dump's
        own options would write it) goes: the placeholder's quotes are replaced with it too."""
        self._payloads.append(json_text)
        self._raw.append(True)
        return self._placeholder(len(self._payloads) - 1)

    @staticmethod
    def _placeholder(i: int) -> str:
        return f"fdr3-payload-{_NONCE}-{i}"

    def _split(self, text: str) -> list[str]:
        """text around the placeholders: len(payloads) + 1 pieces."""
        pieces: list[str] = []
        rest = text
        for i, raw in enumerate(self._raw):
            head, found, rest = rest.partition(f'"{self._placeholder(i)}"' if raw else self._placeholder(i))
            if not found:
                raise ValueError(f"payload {i} was held but its placeholder is not in the answer (out of order?)")
            pieces.append(head)
        pieces.append(rest)
        return pieces

    def dumps(self, obj: Any, **json_kwargs: Any) -> str:
        """json.dumps(obj, **json_kwargs) with every held payload in its placeholder's place (each
        placeholder must occur in obj exactly once, as a string value)."""
        text = json.dumps(obj, **json_kwargs)
        if not self._payloads:
            return text
        pieces = self._split(text)
        parts: list[str] = []
        for head, payload in zip(pieces, self._payloads):
            parts += (head, payload if isinstance(payload, str) else bytes(payload).decode("ascii"))
        parts.append(pieces[-1])
        return "".join(parts)

    def dumps_bytes(self, obj: Any, prefix: str = "", suffix: str = "", **json_kwargs: Any) -> bytes:
        """(prefix + dumps(obj) + suffix) in UTF-8, the payloads copied once, straight from their buffers."""
        pieces = self._split(prefix + json.dumps(obj, **json_kwargs) + suffix)
        parts: list[bytes | memoryview] = []
        for head, payload in zip(pieces, self._payloads):
            parts += (head.encode("utf-8"), payload.encode("utf-8") if isinstance(payload, str) else payload)
        parts.append(pieces[-1].encode("utf-8"))
        return b"".join(parts)


def dumps_choices(obj: Any, **json_kwargs: Any) -> str:
    """json.dumps of an OpenAI answer or stream chunk, the routed_experts of its choices spliced in."""
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not choices or not any(isinstance(c, dict) and isinstance(c.get("routed_experts"), str) for c in choices):
        return json.dumps(obj, **json_kwargs)
    spliced = SplicedJson()
    held = [{**c, "routed_experts": spliced.hold(c["routed_experts"])}
            if isinstance(c, dict) and isinstance(c.get("routed_experts"), str) else c for c in choices]
    return spliced.dumps({**obj, "choices": held}, **json_kwargs)


def json_answer(content: Any) -> Response:
    """An OpenAI answer rendered as Starlette's JSONResponse renders it (compact, UTF-8, no NaN), the
    choices' routed_experts spliced in."""
    body = dumps_choices(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return Response(body, media_type="application/json")
