"""Issue 11 against the real server (subprocess, tiny GLM, R3 into a local store): what one client
sends or does cannot hurt another, and what the server says does not leak its insides.

    F1  parameters the sampler cannot run are made safe (greedy) or refused (400), alone
    F2  a huge body is refused (413) before it is read, a huge prompt (400) before it is tokenized
    F3  a client that hangs up, streaming or not, has its request aborted and its blocks freed
    F5  a 201-character rollout id is refused before generation; 200 characters store fine
    F6  one id per request: in flight or already stored -> 409, unless overwrite_rollout
    also  429 + Retry-After past the waiting bound, 504 past a request's deadline, strict bools,
          routed_experts_start past the prompt -> 400, no /docs, no local_store_dir, 500s without paths

One engine running one request at a time (max_num_seqs 1) with a waiting bound of 1, so that the
queue bound is reachable with three requests.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import time
from collections.abc import Iterator

import httpx
import pytest
from api_server_process import ServerHandle, api_server

from fastdeploy_r3.client import read_local_rollout

API_KEY = "iso-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0}  # tens of seconds on the CPU


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("r3store"))


@pytest.fixture(scope="module")
def server(fake_model_dir, store_dir: str, tmp_path_factory) -> Iterator[ServerHandle]:
    r3 = f'{{"enable_routing_replay": true, "routing_store_type": "local", "local_store_dir": "{store_dir}"}}'
    with api_server(fake_model_dir("glm4_moe"), str(tmp_path_factory.mktemp("logs")), "--routing-replay-config", r3,
                    "--api-key", API_KEY, "--max-model-len", "1024", "--max-num-seqs", "1",
                    "--max-waiting-requests", "1", "--max-request-body-mb", "1") as handle:
        yield handle


def post(server: ServerHandle, body: dict, timeout: float = 120.0, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=timeout)


def engine_metrics(server: ServerHandle) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=30).text
    prefix = "fastdeploy_r3_engine_"
    return {line.split()[0][len(prefix):]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith(prefix)}


def wait_idle(server: ServerHandle, within_s: float) -> float:
    """Seconds until the engine runs nothing and every KV block is free again; fails after within_s."""
    t0 = time.monotonic()
    while True:
        m = engine_metrics(server)
        if m["num_running"] == 0 and m["num_waiting"] == 0 and m["num_free_gpu_blocks"] == m["num_gpu_blocks"]:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within_s, f"engine still busy after {within_s} s: {m}"
        time.sleep(0.05)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# -- F1: parameters the sampler cannot run ------------------------------------------------------------


def test_f1_a_vanishing_temperature_and_an_overlong_seed_do_not_fail_their_neighbours(server: ServerHandle) -> None:
    """F1: temperature 1e-300 or a seed >= 2**64 made the worker step raise: 500 for every request of it.
    (This server runs one request per step; tests/engine/test_isolation.py shares steps between them.)"""
    body = {"prompt": [20, 21, 22, 23], "max_tokens": 6, "ignore_eos": True, "return_routed_experts": False}
    tiny, seeded, bad_seed = (post(server, {**body, **extra})
                              for extra in ({"temperature": 1e-300}, {"seed": 2**64 - 1}, {"seed": 2**64}))
    greedy = post(server, {**body, "temperature": 0})
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert seeded.status_code == 200
    assert "seed" in error_of(bad_seed, 400)["message"]


# -- F2: bounds before cost ---------------------------------------------------------------------------


def test_f2_a_body_over_the_limit_is_refused_before_it_is_read(server: ServerHandle) -> None:
    t0 = time.monotonic()
    r = post(server, {"prompt": "x" * (2 * 2**20), "max_tokens": 1})
    assert "larger than 1 MiB" in error_of(r, 413)["message"]
    assert time.monotonic() - t0 < 10
    # without Content-Length (chunked upload) the body is cut off at the bound too
    chunks = (b'{"prompt": "' + b"y" * 2**16 for _ in range(40))
    r = httpx.post(f"{server.url}/v1/completions", content=chunks, headers={**AUTH, "Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 413, r.text
    assert httpx.get(f"{server.url}/health", headers=AUTH, timeout=5).status_code == 200


def test_f2_a_prompt_longer_than_max_model_len_can_hold_is_refused_before_tokenizing(server: ServerHandle) -> None:
    text = "word " * 60_000  # 300,000 characters: more than 1024 tokens of at most 256 characters
    t0 = time.monotonic()
    err = error_of(post(server, {"prompt": text, "max_tokens": 1}), 400)
    assert "300000 characters" in err["message"] and err["param"] == "prompt"
    err = error_of(post(server, {"messages": [{"role": "user", "content": text}], "max_tokens": 1},
                        path="/v1/chat/completions"), 400)
    assert "characters" in err["message"] and err["param"] == "messages"
    assert time.monotonic() - t0 < 10


# -- F3: disconnects ---------------------------------------------------------------------------------


def test_f3_a_non_streaming_client_that_hangs_up_has_its_request_aborted(server: ServerHandle) -> None:
    wait_idle(server, 60)
    with pytest.raises(httpx.ReadTimeout):
        post(server, {"prompt": "hang up on me", **LONG}, timeout=1.5)
    # aborted within a step or so; 1000 tokens would take far longer
    assert wait_idle(server, within_s=8.0) < 8.0
    assert engine_metrics(server)["num_running"] == 0


def test_f3_a_native_generate_client_that_hangs_up_has_its_rollout_aborted(server: ServerHandle) -> None:
    """SGLang's /generate, non-streaming: the same as /v1/completions."""
    wait_idle(server, 60)
    body = {"text": "hang up on me too", "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True,
                                                              "temperature": 0}}
    with pytest.raises(httpx.ReadTimeout):
        post(server, body, timeout=1.5, path="/generate")
    assert wait_idle(server, within_s=8.0) < 8.0
    assert engine_metrics(server)["num_running"] == 0


def test_f3_a_streaming_client_that_hangs_up_has_its_request_aborted(server: ServerHandle) -> None:
    wait_idle(server, 60)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": "stream then leave", "stream": True,
                                                                   **LONG}, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"text"' in first
    assert wait_idle(server, within_s=8.0) < 8.0


# -- waiting bound and deadlines ------------------------------------------------------------------------


def test_past_the_waiting_bound_the_server_answers_429_with_retry_after(server: ServerHandle) -> None:
    wait_idle(server, 60)
    body = {"prompt": "queue", "max_tokens": 60, "ignore_eos": True, "return_routed_experts": False}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, server, body)
        deadline = time.monotonic() + 30
        while engine_metrics(server)["num_running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        waiting = pool.submit(post, server, body)
        while engine_metrics(server)["num_waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = post(server, body)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "busy" in refused.json()["error"]["message"]
        assert running.result().status_code == 200 and waiting.result().status_code == 200


def test_a_request_past_its_deadline_is_aborted_with_504(server: ServerHandle) -> None:
    wait_idle(server, 60)
    err = error_of(post(server, {"prompt": "slow", "timeout": 0.5, **LONG}), 504)
    assert "deadline" in err["message"] and err["param"] == "timeout"
    assert wait_idle(server, within_s=8.0) < 8.0
    assert error_of(post(server, {"prompt": "x", "timeout": 0}), 400)["param"] == "timeout"


def test_a_stream_past_its_deadline_ends_with_a_504_event_after_its_tokens(server: ServerHandle) -> None:
    wait_idle(server, 60)
    events = []
    body = {"prompt": "slow", "timeout": 1.5, "stream": True, **LONG}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200  # the first token came in time: the status is sent
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    tokens = [e for e in events if '"choices"' in e]
    errors = [json.loads(e)["error"] for e in events if '"error"' in e]
    assert tokens and len(tokens) < LONG["max_tokens"]
    assert len(errors) == 1 and errors[0]["code"] == 504 and "deadline" in errors[0]["message"], events[-2:]
    assert wait_idle(server, within_s=8.0) < 8.0  # the engine request was aborted


# -- F5 / F6: rollout ids -------------------------------------------------------------------------------


def test_f5_an_id_too_long_for_a_file_name_is_refused_before_generation(server: ServerHandle, store_dir) -> None:
    err = error_of(post(server, {"prompt": "x", "max_tokens": 1, "rollout_id": "r" * 201}), 400)
    assert "1-200 characters" in err["message"] and str(store_dir) not in err["message"]
    ok = post(server, {"prompt": "x", "max_tokens": 2, "n": 2, "rollout_id": "r" * 200})
    assert ok.status_code == 200, ok.text
    assert read_local_rollout(store_dir, "r" * 200, choice=1).shape[0] == ok.json()["usage"]["prompt_tokens"] + 1


def test_f6_an_id_already_stored_is_refused_unless_the_request_overwrites(server: ServerHandle, store_dir) -> None:
    body = {"prompt": "first", "max_tokens": 2, "temperature": 0, "rollout_id": "coll"}
    assert post(server, {**body, "n": 2}).status_code == 200
    err = error_of(post(server, body), 409)
    assert "already has routed_experts" in err["message"] and err["param"] == "rollout_id"
    assert post(server, {**body, "rollout_id": "coll_0"}).status_code == 200  # no longer coll's choice 0
    assert sorted(os.listdir(store_dir)).count("coll_0.npy") == 1
    again = post(server, {**body, "prompt": "second prompt", "overwrite_rollout": True})
    assert again.status_code == 200
    stored = read_local_rollout(store_dir, "coll")
    assert stored.shape[0] == again.json()["usage"]["prompt_tokens"] + 1


def test_f6_concurrent_requests_with_one_id_one_wins_the_others_get_409(server: ServerHandle, store_dir) -> None:
    wait_idle(server, 60)
    body = {"prompt": "race", "max_tokens": 30, "ignore_eos": True, "rollout_id": "race-1"}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        codes = sorted(r.status_code for r in pool.map(lambda _: post(server, body), range(4)))
    assert codes == [200, 409, 409, 409]
    assert read_local_rollout(store_dir, "race-1").shape[0] > 0


# -- validation and exposure ----------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [("return_routed_experts", "yes"), ("stream", 1), ("ignore_eos", "true"),
                                              ("max_tokens", "5"), ("overwrite_rollout", "no")])
def test_values_of_the_wrong_json_type_are_refused_not_coerced(server: ServerHandle, field: str, value) -> None:
    err = error_of(post(server, {"prompt": "x", field: value}), 400)
    assert err["param"] == field


def test_routed_experts_start_past_the_prompt_is_a_400_not_a_silent_clamp(server: ServerHandle) -> None:
    err = error_of(post(server, {"prompt": [20, 21, 22], "max_tokens": 4, "routed_experts_start": 3}), 400)
    assert "routed_experts_start=3" in err["message"] and "use at most 2" in err["message"]
    assert post(server, {"prompt": [20, 21, 22], "max_tokens": 4, "routed_experts_start": 2}).status_code == 200


def test_no_docs_no_store_path_and_metrics_behind_the_key(server: ServerHandle, store_dir: str) -> None:
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(f"{server.url}{path}", timeout=10).status_code == 401  # every path is keyed
        assert httpx.get(f"{server.url}{path}", headers=AUTH, timeout=10).status_code == 404  # and docs are off
    card = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).json()["data"][0]
    assert "local_store_dir" not in card["r3"] and str(store_dir) not in str(card)
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 401  # it says what is degraded, and why
    for path in ("/get_server_info", "/server_info", "/model_info", "/v1/loads", "/health"):
        body = httpx.get(f"{server.url}{path}", headers=AUTH, timeout=10)
        assert body.status_code == 200 and str(store_dir) not in body.text and "local_store_dir" not in body.text


def test_a_failed_store_says_what_failed_without_the_path(server: ServerHandle, store_dir: str) -> None:
    parked = store_dir + ".parked"
    os.rename(store_dir, parked)
    with open(store_dir, "w") as f:  # the store directory is now a file: every put fails
        f.write("not a directory")
    try:
        err = error_of(post(server, {"prompt": "lost", "max_tokens": 2, "rollout_id": "lost"}), 500)
    finally:
        os.unlink(store_dir)
        shutil.move(parked, store_dir)
    # the store is asked for the id before anything runs: the request fails before it generates
    assert err["message"].startswith("the R3 store could not reserve rollout 'lost' (request cmpl-")
    assert store_dir not in err["message"] and "Errno" not in err["message"]
    health = httpx.get(f"{server.url}/health", headers=AUTH, timeout=10).json()
    assert health["status"] == "degraded" and store_dir not in health["r3_store"]


def test_files_written_by_the_store_are_private(server: ServerHandle, store_dir: str) -> None:
    assert post(server, {"prompt": "private", "max_tokens": 2, "rollout_id": "private-1"}).status_code == 200
    assert os.stat(os.path.join(store_dir, "private-1.npy")).st_mode & 0o077 == 0


def test_the_server_still_serves_after_all_of_the_above(server: ServerHandle) -> None:
    r = post(server, {"prompt": "still here", "max_tokens": 3, "return_routed_experts": False})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
