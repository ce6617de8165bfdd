"""The soak's rollout race: one rollout id written at the same moment by two requests to the server
and by another server's writer on the same p2pstore (a RedisRoutingStore of this process, as a
second engine on another machine would hold it). Exactly one may win; the others must be told so
(409, RolloutConflictError), and what the store holds must be the winner's rows, never a swap.
"""

from __future__ import annotations

import threading
import uuid

import httpx
import numpy as np
from soak_load import CLEAR, OK, REFUSED, UNCLEAR, WRONG, Outcome, expected_rows

from fastdeploy_r3.client import read_redis_rollout
from fastdeploy_r3.r3.reservation import RolloutConflictError
from fastdeploy_r3.r3.stores import RedisRoutingStore, RoutingStoreError

PROMPTS = ([20, 21, 22], [30, 31, 32, 33, 34, 35, 36])  # lengths tell the writers' rows apart


def rollout_race(server_url: str, redis_url: str, namespace: str) -> list[Outcome]:
    """Outcomes of the two requests (the other writer's result decides whether theirs were right)."""
    rid = f"race-{uuid.uuid4().hex[:12]}"
    other = RedisRoutingStore(redis_url, namespace, ttl_s=600)
    answers: list[httpx.Response | Exception | None] = [None, None]
    other_won: list[bool] = []
    gate = threading.Barrier(3)

    def request(i: int) -> None:
        gate.wait()
        body = {"prompt": PROMPTS[i], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "rollout_id": rid}
        try:
            answers[i] = httpx.post(f"{server_url}/v1/completions", json=body, timeout=60)
        except httpx.HTTPError as e:
            answers[i] = e

    def other_writer() -> None:
        gate.wait()
        try:
            mine = other.reserve(rid, 60, overwrite=False, moe_layer_ids=[0])
        except (RolloutConflictError, RoutingStoreError):
            return
        other_won.append(True)
        rows = np.zeros((1, 1, 1), np.uint8)  # [T, L, K]: a row no request of the server ever writes
        other.put(rid, [rows], [0], reservation=mine)
        other.unreserve(mine)

    threads = [threading.Thread(target=request, args=(i,)) for i in range(2)] + [threading.Thread(target=other_writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    other.close()
    outcomes = []
    winners = [a for a in answers if isinstance(a, httpx.Response) and a.status_code == 200]
    for a in answers:
        if isinstance(a, Exception) or a is None:
            outcomes.append(Outcome("race", REFUSED, repr(a)))
        elif a.status_code == 409:
            outcomes.append(Outcome("race", CLEAR, a.text))
        elif a.status_code != 200:
            outcomes.append(Outcome("race", CLEAR if a.status_code in (429, 500, 503, 504) else UNCLEAR, a.text))
        elif len(winners) + len(other_won) > 1:
            outcomes.append(Outcome("race", WRONG, f"{rid}: two writers were told they won"))
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
