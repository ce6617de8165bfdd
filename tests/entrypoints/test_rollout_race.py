"""Two real servers share one R3 store and get the same rollout id at the same moment: exactly one
answers 200 and its R3 is what the store holds; the other answers 409 before generating. Before, both
answered 200 and the store held the other request's R3 (same shape, so a trainer could not notice).

The two servers share a real `redis-server` (the p2pstore; the session's, tests/conftest.py), the
store RL deployments put between machines; they are started together. The server path is the same
for every store, so the local directory's and Mooncake's reservations are raced store object against
store object in tests/r3/test_conditional_writes.py."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
from api_server_process import ServerHandle, api_servers

from fastdeploy_r3.client import read_redis_rollout

MOE_LAYER_IDS = [1, 2, 3]  # the fake glm4_moe: layer 0 dense
# different prompt lengths: the stored row count says which server's request wrote the rollout
PROMPTS = ("a b", "a b c d e f g h i j")
NAMESPACE = "race2srv"


@dataclass
class SharedStore:
    servers: list[ServerHandle]
    read: Callable[..., np.ndarray]  # read(rollout_id, choice=None) -> [T-1, L, K]; KeyError when absent


@pytest.fixture(scope="module")
def shared(redis_url: str, fake_model_dir, tmp_path_factory) -> Iterator[SharedStore]:
    store = {"routing_store_type": "p2pstore", "p2pstore_url": redis_url, "ttl_s": 600}
    read = lambda rid, choice=None: read_redis_rollout(redis_url, NAMESPACE, rid, choice=choice)  # noqa: E731
    cfg = json.dumps({"enable_routing_replay": True, "debug_mode": True, **store})
    logs = str(tmp_path_factory.mktemp("logs"))
    model = fake_model_dir("glm4_moe")
    args = ("--routing-replay-config", cfg, "--r3-namespace", NAMESPACE, "--max-model-len", "64",
            "--num-gpu-blocks-override", "32")
    with api_servers(logs, (model, *args), (model, *args)) as servers:  # started together: half the wait
        yield SharedStore(servers, read)


def _complete(server: ServerHandle, prompt: str, rollout_id: str, **extra: object) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "rollout_id": rollout_id,
            **extra}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def test_same_rollout_id_on_two_servers_at_once_has_one_winner_and_its_r3_is_stored(shared: SharedStore) -> None:
    with ThreadPoolExecutor(2) as pool:
        for round_ in range(5):
            rid = f"race-{round_}"
            futures = [pool.submit(_complete, s, p, rid) for s, p in zip(shared.servers, PROMPTS, strict=True)]
            answers = [f.result() for f in futures]
            assert sorted(r.status_code for r in answers) == [200, 409], [r.text for r in answers]
            winner = next(r.json() for r in answers if r.status_code == 200)
            loser = next(r.json() for r in answers if r.status_code == 409)
            assert "rollout id" in loser["error"]["message"] and loser["error"]["param"] == "rollout_id"
            stored = shared.read(rid)
            rows = winner["usage"]["prompt_tokens"] + 6 - 1  # P + N - 1: the two prompts differ in P
            assert stored.shape == (rows, len(MOE_LAYER_IDS), 4)
            assert (stored == stored[:, :1, :1]).all() and stored[:, 0, 0].tolist() == list(range(rows))  # debug ids


def test_overwrite_on_the_other_server_replaces_the_whole_rollout_choice_count_included(shared: SharedStore) -> None:
    (a, b), rid = shared.servers, "ow"
    assert _complete(a, PROMPTS[0], rid, n=2, seed=1).status_code == 200
    again = _complete(b, PROMPTS[1], rid)
    assert again.status_code == 409 and "overwrite_rollout" in again.json()["error"]["message"]
    replaced = _complete(b, PROMPTS[1], rid, overwrite_rollout=True)
    assert replaced.status_code == 200
    assert shared.read(rid).shape[0] == replaced.json()["usage"]["prompt_tokens"] + 6 - 1
    for choice in (0, 1):  # the n = 2 choices are gone with the rollout they belonged to
        with pytest.raises(KeyError):
            shared.read(rid, choice)
