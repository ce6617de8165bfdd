"""The typed messages of prefill/decode disaggregation.

    client/router -> P and D   Bootstrap: bootstrap_host, bootstrap_port, bootstrap_room (SGLang's fields)
    P -> D                     Handoff, over P's bootstrap server (JSON, checked field by field here)

A handoff is published once P's prompt is computed, its first token sampled and its blocks (KV with
their R3 rows, one blob each; the partial last one stored as the request ended) written through to
the shared KV store. D checks that it is the same prompt (length and digest) under the same weight
version before it continues from the token.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

from fastdeploy_r3.entrypoints.openai.errors import bad_request
from fastdeploy_r3.logprobs import TokenLogprob
from fastdeploy_r3.sampling_params import InvalidRequestError

MAX_ROOM = 2**64 - 1  # SGLang's router draws rooms as u64


UPDATE_BOTH = "update both to the same weights before sending them requests (rows of two versions never mix)"


class HandoffError(RuntimeError):
    """The prefill side could not hand this request over (unreachable, failed, another prompt, another
    weight version): the decode server answers 502 with this message and runs nothing."""


@dataclass(frozen=True)
class Bootstrap:
    """Where a request's prefill runs: P's bootstrap server and the room that names the request there."""

    host: str
    port: int
    room: int

    @classmethod
    def of(cls, host: str | None, port: int | None, room: int | None) -> Bootstrap | None:
        """The request's bootstrap fields, all three or none (InvalidRequestError names what is wrong)."""
        given = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
        if all(v is None for v in given.values()):
            return None
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise InvalidRequestError(f"{', '.join(missing)} missing: a prefill/decode request carries "
                                      "bootstrap_host, bootstrap_port and bootstrap_room together")
        assert host is not None and port is not None and room is not None
        if not 1 <= port <= 65535:
            raise InvalidRequestError(f"bootstrap_port={port}; use a TCP port in [1, 65535]")
        if not 0 <= room <= MAX_ROOM:
            raise InvalidRequestError(f"bootstrap_room={room}; use an integer in [0, 2^64)")
        return cls(host, port, room)


def pd_bootstrap(host: str | None, port: int | None, room: int | None, single: bool = True) -> Bootstrap | None:
    """A request's bootstrap fields for the serving paths: a 400 (OpenAIError) names what is wrong."""
    try:
        boot = Bootstrap.of(host, port, room)
        if boot is not None and not single:
            raise InvalidRequestError("bootstrap fields name one request's room: send one prompt with n = 1")
    except InvalidRequestError as e:
        raise bad_request(str(e), "bootstrap_room") from e
    return boot


def prompt_digest(prompt_token_ids: list[int]) -> str:
    """What D compares to be sure P computed this very prompt (a room reused for another is refused)."""
    return hashlib.sha256(b",".join(str(t).encode() for t in prompt_token_ids)).hexdigest()


@dataclass(frozen=True)
class Handoff:
    """What P tells D about a room. `error` set: P failed the request, and D fails it with this reason."""

    room: int
    weight_version: str
    num_prompt_tokens: int
    prompt_digest: str
    token_id: int = -1  # the first output token, sampled by P
    text: str = ""  # its text as P's response has it (trimmed if it is a stop token)
    logprob: TokenLogprob | None = None  # when the request asked for logprobs
    finish_reason: str | None = None  # P's, with max_tokens 1: "length", or "stop" when the token ends it
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0  # P's own prefix hit (GPU pool or tiers), for the log
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> Handoff:
        """A handoff from P's JSON; HandoffError when any field is missing or of the wrong type."""
        try:
            if not isinstance(raw, dict) or set(raw) != {f for f in cls.__dataclass_fields__}:
                raise TypeError(f"fields {sorted(raw) if isinstance(raw, dict) else type(raw).__name__}")
            lp = raw["logprob"]
            logprob = None if lp is None else TokenLogprob(
                token_id=_int(lp["token_id"]), logprob=float(lp["logprob"]), rank=_int(lp["rank"]),
                top=[(_int(t), float(v)) for t, v in lp["top"]],
                entropy=None if lp.get("entropy") is None else float(lp["entropy"]),
                kept_ids=None if lp.get("kept_ids") is None else [_int(t) for t in lp["kept_ids"]])
            stop_reason = raw["stop_reason"]
            if stop_reason is not None and not isinstance(stop_reason, (str, int)):
                raise TypeError(f"stop_reason {stop_reason!r}")
            return cls(room=_int(raw["room"]), weight_version=_str(raw["weight_version"]),
                       num_prompt_tokens=_int(raw["num_prompt_tokens"]), prompt_digest=_str(raw["prompt_digest"]),
                       token_id=_int(raw["token_id"]), text=_str(raw["text"]), logprob=logprob,
                       finish_reason=None if raw["finish_reason"] is None else _str(raw["finish_reason"]),
                       stop_reason=stop_reason, num_cached_tokens=_int(raw["num_cached_tokens"]),
                       error=None if raw["error"] is None else _str(raw["error"]))
        except (KeyError, TypeError, ValueError) as e:
            raise HandoffError(f"the prefill server sent a malformed handoff ({e}); are P and D the same "
                               "fastdeploy_r3 version?") from None

    def check_for(self, room: int, prompt_token_ids: list[int], weight_version: str | None = None) -> None:
        """HandoffError unless this hands over `prompt_token_ids` of `room`, computed by `weight_version`
        (None: the engine checks it, as the request arrives: roles.py)."""
        if self.error is not None:
            raise HandoffError(f"the prefill server failed room {room}: {self.error}")
        if self.room != room:
            raise HandoffError(f"the prefill server answered room {self.room} for room {room}")
        if (self.num_prompt_tokens, self.prompt_digest) != (len(prompt_token_ids), prompt_digest(prompt_token_ids)):
            raise HandoffError(f"room {room} on the prefill server holds another prompt ({self.num_prompt_tokens} "
                               f"tokens) than this request's ({len(prompt_token_ids)}); send each request's own room")
        if weight_version is not None and self.weight_version != weight_version:
            raise HandoffError(f"the prefill server computed room {room} with weight_version "
                               f"{self.weight_version!r}, this decode server has {weight_version!r}: {UPDATE_BOTH}")


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {v!r}")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {v!r}")
    return v
