"""The growing lists of SGLang's cumulative `/generate` stream chunks, kept as JSON text.

Every chunk of a streamed `/generate` repeats the request's whole output so far: text, output_ids and,
when asked for, output_token_logprobs, output_top_logprobs and output_token_entropy. Encoding them
afresh for every chunk is O(tokens) of json.dumps per chunk, O(tokens^2) per request: at 256 streams
it was the API server's largest single cost. Here each delta's new entries are encoded once, when
the delta arrives, and a chunk joins the text already encoded (a memcpy) into its answer
(payload_json.SplicedJson.hold_raw).

Byte-for-byte the JSON json.dumps(answer, allow_nan=False) writes with its default separators and
ensure_ascii: a list's entries are joined by ", ", a string's characters are escaped one by one (so
the escapes of the pieces, concatenated, are the escape of the whole). tests/entrypoints/
test_stream_chunks.py holds the two to the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastdeploy_r3.entrypoints.payload_json import SplicedJson
from fastdeploy_r3.outputs import CompletionDelta


class _JsonList:
    """A JSON array built one run of entries at a time."""

    def __init__(self) -> None:
        self._runs: list[str] = []  # each the entries of one delta, ", "-joined, brackets off

    def extend(self, entries: list[Any]) -> None:
        if entries:
            self._runs.append(json.dumps(entries, allow_nan=False)[1:-1])

    def text(self) -> str:
        if len(self._runs) > 1:
            self._runs = [", ".join(self._runs)]  # joined once; later chunks join onto it
        return f"[{self._runs[0]}]" if self._runs else "[]"


class CumulativeJson:
    """One choice's output so far, as the JSON of the answer's cumulative fields.

    logprob_entry(token_id, record) gives an output_token_logprobs entry, top_entries(record) the
    output_top_logprobs entry of a token (the answer's own functions, so that both render alike)."""

    def __init__(self, logprob_entry: Callable[[int, Any], list[Any]] | None,
                 top_entries: Callable[[Any], list[list[Any]]] | None, entropy: bool) -> None:
        self.logprob_entry, self.top_entries, self.entropy = logprob_entry, top_entries, entropy
        self.num_tokens = 0
        self.last: CompletionDelta | None = None  # the newest delta: finish reason, versions, spans
        self._text: list[str] = []
        self._ids, self._logprobs, self._tops, self._entropies = _JsonList(), _JsonList(), _JsonList(), _JsonList()

    def add(self, c: CompletionDelta, on_mismatch: Callable[[str], Exception]) -> None:
        records = c.logprobs or []
        if self.logprob_entry is not None:
            if len(records) != len(c.token_ids):
                raise on_mismatch(f"the engine sent {len(records)} logprobs for {len(c.token_ids)} tokens")
            self._logprobs.extend([self.logprob_entry(t, r) for t, r in zip(c.token_ids, records)])
            if self.top_entries is not None:
                self._tops.extend([self.top_entries(r) for r in records])
        if self.entropy:
            self._entropies.extend([r.entropy for r in records])
        self._ids.extend(list(c.token_ids))
        if c.text:
            self._text.append(json.dumps(c.text)[1:-1])
        self.num_tokens += len(c.token_ids)
        self.last = c

    def fields(self, spliced: SplicedJson) -> dict[str, str]:
        """The answer's cumulative fields by name, each a placeholder of `spliced` for its JSON."""
        if len(self._text) > 1:
            self._text = ["".join(self._text)]
        out = {"text": spliced.hold_raw(f'"{self._text[0]}"' if self._text else '""'),
               "output_ids": spliced.hold_raw(self._ids.text())}
        if self.logprob_entry is not None:
            out["output_token_logprobs"] = spliced.hold_raw(self._logprobs.text())
            if self.top_entries is not None:
                out["output_top_logprobs"] = spliced.hold_raw(self._tops.text())
        if self.entropy:
            out["output_token_entropy"] = spliced.hold_raw(self._entropies.text())
        return out
