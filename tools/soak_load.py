"""The mixed request load of tools/soak.py and the fault-matrix test, and how each request ended.

Every request ends in exactly one outcome. A server with R3 in debug mode writes position p into
every id of token p, so a response's R3 is checked without a reference: row i of a choice holds
routed_experts_start + i (mod the dtype's sentinel), and the rows cover exactly the prompt and the
completion tokens the usage reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np

from fastdeploy_r3.client import decode_routed_experts, read_redis_rollout

OK, BAD_OK, CLEAR, REFUSED, GAVE_UP, CUT, HUNG, WRONG, UNCLEAR = (
    "served, R3 exact", "bad request refused (400)", "failed with a clear error", "refused while restarting",
    "client gave up (disconnect/abort)", "cut by an exiting API server", "hung", "wrong R3 rows", "unclear errors")
OUTCOMES = (OK, BAD_OK, CLEAR, REFUSED, GAVE_UP, CUT, HUNG, WRONG, UNCLEAR)
MUST_BE_ZERO = (HUNG, WRONG, UNCLEAR)

HELD_TOKENS = 90  # with a prompt of at most 28 tokens, within a max_model_len of 128
KINDS = (("plain", 35), ("n2", 10), ("stream", 20), ("abort", 8), ("disconnect", 7), ("bad", 10), ("long", 10))
BAD_BODIES = ({"max_tokens": -1}, {"prompt": [10**7]}, {"temperature": -1.0}, {"n": 0}, {"no_such_field": 1},
              {"prompt": []})
TOKEN_LO, TOKEN_HI = 16, 250  # plain tokens of the tiny fake vocabulary, clear of special ones


@dataclass
class Target:
    """Where requests go and where their R3 comes back."""

    url: str
    r3_store: tuple[str, str] | None = None  # (redis url, namespace) when R3 goes to the p2pstore
    server_alive: Callable[[], bool] = lambda: True  # a connection cut by a live server is unclear


@dataclass
class Outcome:
    kind: str
    outcome: str
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Stats:
    outcomes: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    examples: dict[str, str] = field(default_factory=dict)  # the first message per outcome worth reading

    def add(self, o: Outcome) -> None:
        self.outcomes[o.outcome] += 1
        if o.outcome == OK:
            self.latencies.append(o.seconds)
        if o.outcome in (HUNG, WRONG, UNCLEAR, CLEAR) and o.outcome not in self.examples:
            self.examples[o.outcome] = o.detail[:300]


class Load:
    """Request bodies of a mixed load, and one request sent and judged."""

    def __init__(self, seed: int = 0, hang_after_s: float = 90.0) -> None:
        self.rng = random.Random(seed)
        self.hang_after_s = hang_after_s
        self.prefixes = [[self.rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(16)] for _ in range(6)]
        self.kinds = [k for k, w in KINDS for _ in range(w)]
        self.held_streaming: asyncio.Event | None = None  # set at the first event of a "held" stream

    def held_event(self) -> asyncio.Event:
        """Set once some "held" stream has its first event (made in the running loop)."""
        if self.held_streaming is None:
            self.held_streaming = asyncio.Event()
        return self.held_streaming

    def pick_kind(self) -> str:
        return self.rng.choice(self.kinds)

    def body(self, kind: str) -> dict:
        rng = self.rng
        suffix = [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(rng.randint(1, 12))]
        prompt = list(rng.choice(self.prefixes)) + suffix
        body: dict = {"prompt": prompt, "max_tokens": rng.randint(1, 10), "ignore_eos": rng.random() < 0.5,
                      "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(1 << 30),
                      "rollout_id": f"soak-{uuid.uuid4().hex[:12]}"}
        if kind == "n2":
            body["n"] = 2
        if kind == "long":
            body["prompt"] = prompt + [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(40)]
            body["max_tokens"] = rng.randint(10, 40)
        if kind == "held":  # a stream still decoding well after its first token: a fault can meet it
            body.update(max_tokens=HELD_TOKENS, ignore_eos=True)
        if kind in ("stream", "abort", "held"):
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if kind == "bad":
            body.update(rng.choice(BAD_BODIES))
        return body

    async def one(self, client: httpx.AsyncClient, target: Target, kind: str | None = None) -> Outcome:
        kind = kind or self.pick_kind()
        body = self.body(kind)
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.hang_after_s):
                outcome, detail = await self._send(client, target, kind, body)
        except TimeoutError:
            outcome, detail = HUNG, f"{kind} request got no answer within {self.hang_after_s} s: {body}"
        return Outcome(kind, outcome, detail, time.monotonic() - t0)

    async def _send(self, client: httpx.AsyncClient, target: Target, kind: str, body: dict) -> tuple[str, str]:
        url = f"{target.url}/v1/completions"
        try:
            if kind == "disconnect":
                with contextlib.suppress(httpx.TimeoutException):
                    await client.post(url, json=body, timeout=self.rng.uniform(0.05, 0.5))
                return GAVE_UP, ""
            if body.get("stream"):
                return await self._stream(client, target, url, kind, body)
            r = await client.post(url, json=body)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as e:
            return await _transport_outcome(target, e)
        if kind == "bad":
            msg = error_message(safe_json(r))
            if r.status_code == 400 and msg:
                return BAD_OK, ""
            if r.status_code >= 500 and msg:  # the server could not look at it (its engine is gone): clear too
                return CLEAR, f"bad request answered {r.status_code}: {msg}"
            return UNCLEAR, f"bad request {body} answered {r.status_code}: {r.text[:200]}"
        if r.status_code != 200:
            msg = error_message(safe_json(r))
            return (CLEAR, f"{r.status_code}: {msg}") if msg else (UNCLEAR, f"{r.status_code}: {r.text[:200]}")
        return await asyncio.to_thread(check_r3, target, body, r.json())

    async def _stream(self, client: httpx.AsyncClient, target: Target, url: str, kind: str,
                      body: dict) -> tuple[str, str]:  # fmt: skip
        finals: dict[int, dict] = {}
        usage = None
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                msg = error_message(safe_json_bytes(await r.aread()))
                return (CLEAR, f"{r.status_code}: {msg}") if msg else (UNCLEAR, f"stream answered {r.status_code}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if kind == "held":
                    self.held_event().set()
                if kind == "abort":
                    return GAVE_UP, ""  # leaving the block closes the connection: the server aborts it
                if "error" in event:
                    msg = error_message(event)
                    return (CLEAR, msg) if msg else (UNCLEAR, f"error event without a message: {data[:200]}")
                for c in event.get("choices", []):
                    if c.get("finish_reason"):
                        finals[c["index"]] = c
                if event.get("usage"):
                    usage = event["usage"]
        if usage is None or not finals:
            return UNCLEAR, f"stream ended without a final chunk or usage: finals {sorted(finals)}"
        return await asyncio.to_thread(check_r3, target, body, {"choices": list(finals.values()), "usage": usage})


async def _transport_outcome(target: Target, e: Exception) -> tuple[str, str]:
    if isinstance(e, httpx.ConnectError):
        return REFUSED, ""
    # The connection broke mid-answer: acceptable only from an API server that was killed, or that is
    # exiting because its engine is gone (it closes its connections on the way out); a server that
    # keeps running must never drop a request.
    for _ in range(40):
        if not target.server_alive():
            return CUT, ""
        await asyncio.sleep(0.5)
    return UNCLEAR, f"{type(e).__name__} from an API server that kept running: {e}"


def expected_rows(start: int, num_rows: int, dtype: np.dtype) -> np.ndarray:
    """Debug mode's R3 of rows [start, start + num_rows): every id of row i is its position (mod the sentinel)."""
    return (np.arange(start, start + num_rows) % np.iinfo(dtype).max).astype(dtype)  # [rows]


def check_r3(target: Target, body: dict, resp: dict) -> tuple[str, str]:
    """(OK, "") when every choice's R3 is exactly its positions and covers the usage's tokens, else (WRONG, why)."""
    choices = sorted(resp["choices"], key=lambda c: c["index"])
    n = body.get("n", 1)
    if len(choices) != n:
        return UNCLEAR, f"{len(choices)} choices for n={n}"
    p = resp["usage"]["prompt_tokens"]
    n_tokens = 0
    for c in choices:
        try:
            if target.r3_store is not None:
                url, namespace = target.r3_store
                arr = read_redis_rollout(url, namespace, body["rollout_id"], c["index"] if n > 1 else None)
            else:
                arr = decode_routed_experts(c["routed_experts"])
        except Exception as e:  # noqa: BLE001 - a 200 without readable R3 is the worst outcome
            return WRONG, f"choice {c['index']} of {body['rollout_id']}: R3 unreadable: {type(e).__name__}: {e}"
        start = c.get("routed_experts_start") or 0
        want = expected_rows(start, arr.shape[0], arr.dtype)  # [rows]
        if not np.array_equal(arr, np.broadcast_to(want[:, None, None], arr.shape)):
            bad = np.argwhere(arr != want[:, None, None])[:1].tolist()
            return WRONG, f"choice {c['index']} of {body['rollout_id']}: rows differ from positions at {bad}"
        n_tokens += arr.shape[0] + start - p + 1
    if n_tokens != resp["usage"]["completion_tokens"]:
        return WRONG, f"R3 covers {n_tokens} completion tokens, usage says {resp['usage']['completion_tokens']}"
    return OK, ""


def safe_json(r: httpx.Response) -> dict:
    try:
        return r.json()
    except ValueError:
        return {}


def safe_json_bytes(data: bytes) -> dict:
    try:
        return json.loads(data or b"{}")
    except ValueError:
        return {}


def error_message(body: dict) -> str:
    err = body.get("error") if isinstance(body, dict) else None
    return err.get("message", "") if isinstance(err, dict) else ""
