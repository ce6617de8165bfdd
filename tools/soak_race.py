"""The soak's rollout race: one rollout id sent at the same moment to two API servers that share a
p2pstore (Redis) — twice to the server under faults, once to its peer (a second server of the soak
on the same Redis, as a second engine on another machine would be). Exactly one may win; the others
must be told so (409, or a clear error while a fault is on), and what the store holds must be the
winner's rows, never a swap. The three prompts differ in length, so the stored row count says whose
request wrote the rollout.
"""

from __future__ import annotations

import threading
import uuid

import httpx
import numpy as np
from soak_load import CLEAR, OK, REFUSED, UNCLEAR, WRONG, Outcome, error_message, expected_rows, safe_json

from fastdeploy_r3.client import read_redis_rollout

PROMPTS = ([20, 21, 22], [30, 31, 32, 33, 34, 35, 36], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50])
MAX_TOKENS = 4


def rollout_race(server_url: str, peer_url: str, redis_url: str, namespace: str) -> list[Outcome]:
    """One outcome per request: two to `server_url`, one to `peer_url`, all with the same rollout id."""
    rid = f"race-{uuid.uuid4().hex[:12]}"
    urls = (server_url, server_url, peer_url)
    answers: list[httpx.Response | Exception | None] = [None] * len(urls)
    gate = threading.Barrier(len(urls))

    def request(i: int) -> None:
        body = {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "rollout_id": rid}
        gate.wait()
        try:
            answers[i] = httpx.post(f"{urls[i]}/v1/completions", json=body, timeout=60)
        except httpx.HTTPError as e:
            answers[i] = e

    threads = [threading.Thread(target=request, args=(i,)) for i in range(len(urls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    winners = [a for a in answers if isinstance(a, httpx.Response) and a.status_code == 200]
    outcomes = []
    for a in answers:
        if isinstance(a, Exception) or a is None:
            outcomes.append(Outcome("race", REFUSED, repr(a)))
        elif a.status_code != 200:
            clear = a.status_code in (409, 429, 500, 503, 504) and error_message(safe_json(a))
            outcomes.append(Outcome("race", CLEAR if clear else UNCLEAR, f"{a.status_code}: {a.text[:200]}"))
        elif len(winners) > 1:
            outcomes.append(Outcome("race", WRONG, f"{rid}: {len(winners)} writers were told they won"))
        else:
            outcomes.append(_check_stored(a.json(), redis_url, namespace, rid))
    return outcomes


def _check_stored(resp: dict, redis_url: str, namespace: str, rid: str) -> Outcome:
    try:
        arr = read_redis_rollout(redis_url, namespace, rid)
    except Exception as e:  # noqa: BLE001 - a 200 whose R3 cannot be read is a wrong answer
        return Outcome("race", WRONG, f"{rid}: the winner's R3 is unreadable: {type(e).__name__}: {e}")
    rows = resp["usage"]["prompt_tokens"] + resp["usage"]["completion_tokens"] - 1
    want = expected_rows(0, rows, arr.dtype)  # [rows]
    if arr.shape[0] != rows or not np.array_equal(arr, np.broadcast_to(want[:, None, None], arr.shape)):
        return Outcome("race", WRONG, f"{rid}: the store holds another writer's R3 ({arr.shape[0]} rows, want {rows})")
    return Outcome("race", OK)
