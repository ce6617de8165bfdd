"""Prefill/decode disaggregation driven by the registry's sglang-router (0.3.2, `--pd-disaggregation`):
a prefill server, a decode server, the router, a real redis-server as the shared KV store (the
`store` transfer backend), and a colocated server to compare with, all real processes, started once
for the file.

What must hold (docs/pd.md): through PD, greedy tokens and R3 rows equal the colocated server's bit
for bit, P + N - 1 rows, streaming or not, /generate and /v1/completions, with chunked prefill on every
server and preemption on D; D loads every prompt block P stored, the partial last one too (its
cached_tokens), and computes only from P's first token on; the faults end as docs/pd.md says.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from api_server_process import free_port
from pd_deployment import (
    Deployment,
    assert_idle_and_clean,
    assert_swept,
    kill_tree,
    most_unread_bytes,
    pd_deployment,
    server_tree,
)
from redis_server import redis_pid

from fastdeploy_r3.client import decode_routed_experts

NUM_LAYERS, MOE_LAYER_IDS, TOP_K = 4, [1, 2, 3], 4  # the fake glm4_moe: layer 0 dense
BLOCK = 4
D_BLOCKS = 12
R3_ON = '{"enable_routing_replay": true}'
FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "pd", "sglang_router_pd_requests.json")
# a shared prefix of 3 full blocks, then suffixes of different lengths (full and partial last blocks)
PREFIX = [30 + i for i in range(12)]
PROMPTS = [PREFIX + [60 + i for i in range(k)] for k in (0, 1, 3, 4, 6)]


@pytest.fixture(scope="module")
def pd(fake_model_dir, tmp_path_factory) -> Iterator[Deployment]:
    # chunked prefill everywhere (8 tokens a step), and a D with room for 12 blocks: requests in flight
    # together preempt one another there
    common = ("--routing-replay-config", R3_ON, "--enable-return-routed-experts", "--max-model-len", "48",
              "--block-size", str(BLOCK), "--max-num-batched-tokens", "8")
    with pd_deployment(fake_model_dir("glm4_moe"), str(tmp_path_factory.mktemp("pd_logs")), common,
                       ("--num-gpu-blocks-override", str(D_BLOCKS))) as deployment:
        yield deployment


def _generate(url: str, prompt: list[int], max_new_tokens: int = 6, **extra) -> httpx.Response:
    body = {"input_ids": prompt, "return_logprob": True, **extra,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def _rows(meta: dict, num_rows: int) -> np.ndarray:
    rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    return rows.reshape(num_rows, NUM_LAYERS, TOP_K)


def test_server_info_advertises_each_role_and_p_bootstrap_port(pd: Deployment) -> None:
    infos = [httpx.get(f"{s.url}/get_server_info", timeout=30).json() for s in (pd.prefill, pd.decode, pd.colocated)]
    assert [i["disaggregation_mode"] for i in infos] == ["prefill", "decode", "null"]
    assert [i["disaggregation_bootstrap_port"] for i in infos] == [pd.bootstrap_port, None, None]


def _colocated_meanwhile(pd: Deployment, prompts: list[list[int]], max_new_tokens: int) -> Future[list[dict]]:
    """The colocated server's answers, asked in a thread while the test drives P and D (the servers share
    two cores, but each waits on the others' turns often enough that this halves the wall time)."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(lambda: [_generate(pd.colocated.url, p, max_new_tokens).json() for p in prompts])
    pool.shutdown(wait=False)
    return future


def test_generate_through_the_router_equals_colocated_tokens_and_r3_bit_for_bit(pd: Deployment) -> None:
    refs = _colocated_meanwhile(pd, PROMPTS, 6)
    # one at a time: each later prompt finds the shared prefix in P's own cache
    answers = [_generate(pd.router, prompt) for prompt in PROMPTS]
    for prompt, r, ref in zip(PROMPTS, answers, refs.result(), strict=True):
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == ref["output_ids"] and len(out["output_ids"]) == 6
        assert out["text"] == ref["text"], (prompt, out["output_ids"], out["text"], ref["text"])
        # logprobs: the first token's is P's, the rest D's; both computed in other chunk shapes than the
        # colocated run's (P from its prefix hit, D the first token alone), so float-close
        got, want = out["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in got] == [t for _, t, _ in want]
        assert np.allclose([lp for lp, _, _ in got], [lp for lp, _, _ in want], rtol=0, atol=1e-4)
        assert out["meta_info"]["prompt_tokens"] == len(prompt)
        num_rows = len(prompt) + 6 - 1
        assert np.array_equal(_rows(out["meta_info"], num_rows), _rows(ref["meta_info"], num_rows))
        # D loaded every prompt block P stored, the partial last one too: only the first token ran on D
        assert out["meta_info"]["cached_tokens"] == len(prompt)


def test_requests_in_flight_together_preempt_each_other_on_d_and_still_equal_colocated(pd: Deployment) -> None:
    # no shared prefix: 3 blocks each at admission (10 tokens + P's), 10 once decoded (10 + 30 - 1), and D
    # holds 12: any two of them on D at once preempt one another (with shorter outputs two fit, and only
    # three arriving together preempted, which a busy machine did not always do)
    prompts = [[100 + 20 * i + j for j in range(10)] for i in range(3)]
    refs = _colocated_meanwhile(pd, prompts, 30)
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: _generate(pd.router, p, 30), prompts))
    for prompt, r, ref in zip(prompts, answers, refs.result(), strict=True):
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == ref["output_ids"]
        num_rows = len(prompt) + 30 - 1
        assert np.array_equal(_rows(out["meta_info"], num_rows), _rows(ref["meta_info"], num_rows))
    metrics = httpx.get(f"{pd.decode.url}/metrics", timeout=30).text
    preempted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("fastdeploy_r3_engine_preemptions"))
    assert preempted > 0, "D never preempted: the test no longer covers preemption"


def test_seeded_sampling_through_the_router_draws_the_colocated_tokens(pd: Deployment) -> None:
    """A draw's noise is a function of (seed, position) (worker/sample/sampler.py): P draws position P, D the
    ones after, as a colocated server does; the same seed gives the same tokens and rows."""
    refs, answers = [], []
    for i, prompt in enumerate(PROMPTS[1:4]):
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0.9, "top_p": 0.95,
                                                         "sampling_seed": 1000 + i, "ignore_eos": True}}
        refs.append(httpx.post(f"{pd.colocated.url}/generate", json=body, timeout=120).json())
        answers.append(httpx.post(f"{pd.router}/generate", json=body, timeout=120))
    for prompt, r, ref in zip(PROMPTS[1:4], answers, refs, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == ref["output_ids"]
        num_rows = len(prompt) + 8 - 1
        assert np.array_equal(_rows(r.json()["meta_info"], num_rows), _rows(ref["meta_info"], num_rows))
    # not greedy in disguise: another seed draws other tokens for at least one of them
    other = [httpx.post(f"{pd.colocated.url}/generate", timeout=120, json={
        "input_ids": p, "sampling_params": {"max_new_tokens": 8, "temperature": 0.9, "top_p": 0.95,
                                            "sampling_seed": 7, "ignore_eos": True}}).json()["output_ids"]
        for p in PROMPTS[1:4]]
    assert other != [ref["output_ids"] for ref in refs]


def test_streamed_generate_through_the_router_ends_with_the_colocated_tokens_and_r3(pd: Deployment) -> None:
    prompt = PROMPTS[2]
    chunks = []
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", f"{pd.router}/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    ref = _generate(pd.colocated.url, prompt, 5).json()
    last = chunks[-1]
    assert last["output_ids"] == ref["output_ids"]
    assert [c["output_ids"][0] for c in chunks] == [ref["output_ids"][0]] * len(chunks)  # P's token leads
    num_rows = len(prompt) + 5 - 1
    assert np.array_equal(_rows(last["meta_info"], num_rows), _rows(ref["meta_info"], num_rows))


def _completion(url: str, model: str, prompt: str, stream: bool) -> tuple[str, str]:
    """(text, routed_experts) of one greedy /v1/completions call, streamed or not (the router needs `model`)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["text"], c["routed_experts"]
    text, routed = "", None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[len("data: "):])["choices"]:
                    text += c.get("text") or ""
                    routed = c.get("routed_experts") or routed
    assert routed is not None
    return text, routed


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_through_the_router_equal_colocated(pd: Deployment, stream: bool) -> None:
    model = httpx.get(f"{pd.colocated.url}/v1/models", timeout=30).json()["data"][0]["id"]
    prompts = ("the quick brown fox jumps over", "the quick brown fox sleeps")
    with ThreadPoolExecutor(1) as pool:
        refs = pool.submit(lambda: [_completion(pd.colocated.url, model, p, stream) for p in prompts])
        answers = [_completion(pd.router, model, p, stream) for p in prompts]
    for (text, routed), (ref_text, ref_routed) in zip(answers, refs.result(), strict=True):
        assert text == ref_text
        assert np.array_equal(decode_routed_experts(routed), decode_routed_experts(ref_routed))


def test_chat_through_the_router_equals_colocated(pd: Deployment) -> None:
    model = httpx.get(f"{pd.colocated.url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "name a colour"}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(httpx.post, f"{pd.colocated.url}/v1/chat/completions", json=body, timeout=120)
        out = httpx.post(f"{pd.router}/v1/chat/completions", json=body, timeout=120)
        ref = asked.result()
    assert out.status_code == 200, out.text
    got, want = out.json()["choices"][0], ref.json()["choices"][0]
    assert got["message"]["content"] == want["message"]["content"]
    assert np.array_equal(decode_routed_experts(got["routed_experts"]), decode_routed_experts(want["routed_experts"]))


def test_the_recorded_router_bodies_run_on_p_and_d_directly(pd: Deployment) -> None:
    """The exact bodies sglang-router sent a recording stub (tests/fixtures/pd/), posted to P and D as
    it posts them (at once): D answers with P's first token continued, the same as colocated."""
    fixture = json.load(open(FIXTURE))
    assert {(p["role"], p["path"]) for p in fixture["startup_probes"]} == {
        (role, path) for role in ("prefill", "decode") for path in ("/health", "/server_info", "/model_info")}
    forwarded = fixture["forwarded"]
    model = httpx.get(f"{pd.colocated.url}/v1/models", timeout=30).json()["data"][0]["id"]
    for room, (path, stream) in enumerate([("/generate", False), ("/v1/completions", False)], start=7000):
        sent = [f for f in forwarded if f["path"] == path and f["body"].get("stream") is stream]
        assert {f["role"] for f in sent} == {"prefill", "decode"}
        body = {**sent[0]["body"], "bootstrap_port": pd.bootstrap_port, "bootstrap_room": room}
        if body["model"] is not None:  # the stub served "m"
            body["model"] = model
        assert all(f["body"]["bootstrap_room"] == sent[0]["body"]["bootstrap_room"] for f in sent)  # one room, P and D
        with httpx.Client(timeout=120) as client:
            with ThreadPoolExecutor(2) as pool:
                d = pool.submit(client.post, f"{pd.decode.url}{path}", json=body)
                p = pool.submit(client.post, f"{pd.prefill.url}{path}", json=body)
                d_r, p_r = d.result(), p.result()
        assert p_r.status_code == 200, p_r.text
        assert d_r.status_code == 200, d_r.text
        plain = {k: v for k, v in body.items() if not k.startswith("bootstrap_")}
        ref = httpx.post(f"{pd.colocated.url}{path}", json=plain, timeout=120)
        if path == "/generate":
            assert d_r.json()["output_ids"] == ref.json()["output_ids"]
            assert p_r.json()["output_ids"] == ref.json()["output_ids"][:1]  # P samples the first token only
        else:
            assert d_r.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]


def test_a_first_token_that_ends_the_request_comes_from_p_with_the_prompt_rows(pd: Deployment) -> None:
    prompt = PROMPTS[3]
    out = _generate(pd.router, prompt, max_new_tokens=1).json()
    ref = _generate(pd.colocated.url, prompt, max_new_tokens=1).json()
    assert out["output_ids"] == ref["output_ids"] and out["text"] == ref["text"]
    assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
    num_rows = len(prompt)  # P + 1 - 1
    assert np.array_equal(_rows(out["meta_info"], num_rows), _rows(ref["meta_info"], num_rows))


def test_a_closed_bootstrap_port_fails_the_request_on_d_with_502_and_leaves_nothing_running(pd: Deployment) -> None:
    body = {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(), "bootstrap_room": 99}
    started = time.monotonic()
    r = httpx.post(f"{pd.decode.url}/generate", json=body, timeout=60)
    assert r.status_code == 502
    assert "unreachable" in r.json()["error"]["message"]
    assert time.monotonic() - started < 30
    load = httpx.get(f"{pd.decode.url}/v1/loads", timeout=30).json()["loads"][0]
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 0)


def test_a_flipped_byte_in_every_transferred_block_costs_d_a_recompute_never_a_wrong_row(pd: Deployment) -> None:
    """P stores a fresh prompt's blocks and publishes; a byte of each stored blob is flipped before D
    loads them: D's loads fail their checksum, D computes the whole prompt, R3 equals colocated."""
    import redis

    store = redis.Redis.from_url(pd.store_url)
    prompt = [200 + i for i in range(13)]  # no block shared with the other tests' prompts: 3 new blocks
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap_port, "bootstrap_room": 4242}
    before = set(store.keys("*"))
    assert httpx.post(f"{pd.prefill.url}/generate", json=body, timeout=60).status_code == 200  # published
    new = sorted(set(store.keys("*")) - before)
    blobs = [k for k in new if store.type(k) == b"string" and store.strlen(k) > 1024]
    assert len(blobs) == 4  # the prompt's 3 full blocks and its partial last one, KV and rows in one blob each
    for key in blobs:
        middle = store.strlen(key) // 2
        store.setrange(key, middle, bytes([store.getrange(key, middle, middle)[0] ^ 0xFF]))
    r = httpx.post(f"{pd.decode.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    ref = _generate(pd.colocated.url, prompt, 4).json()
    assert out["output_ids"] == ref["output_ids"]
    assert out["meta_info"]["cached_tokens"] == 0  # nothing corrupt was used
    num_rows = len(prompt) + 4 - 1
    assert np.array_equal(_rows(out["meta_info"], num_rows), _rows(ref["meta_info"], num_rows))


def test_p_and_d_on_different_weight_versions_fail_the_request_instead_of_mixing(pd: Deployment) -> None:
    """P keeps the new version name (the case after this one kills P)."""
    r = httpx.post(f"{pd.prefill.url}/update_weight_version", json={"new_version": "pd-other"}, timeout=60)
    assert r.status_code == 200, r.text
    body = {"input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap_port, "bootstrap_room": 123}
    with ThreadPoolExecutor(2) as pool:
        d = pool.submit(httpx.post, f"{pd.decode.url}/generate", json=body, timeout=60)
        p = pool.submit(httpx.post, f"{pd.prefill.url}/generate", json=body, timeout=60)
        d_r, p_r = d.result(), p.result()
    assert p_r.status_code == 200
    assert d_r.status_code == 502
    assert "must run on weight_version 'pd-other', this engine holds '0'" in d_r.json()["error"]["message"]


def test_p_killed_while_its_blocks_are_written_fails_d_with_502_and_leaves_d_clean(pd: Deployment) -> None:
    """Last in the file: P is gone afterwards. P's write-through is held by stopping the store, and P's
    whole tree is SIGKILLed once the first blob of the prompt (KV and rows, > 1 KiB) sits unread in the
    store's socket: D, long-polling for the handoff, answers 502 within seconds."""
    prompt = [230 + i for i in range(13)]  # 3 full blocks no other case stored
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap_port, "bootstrap_room": 300}
    roles, pids = server_tree(pd.prefill)
    redis = redis_pid(pd.store_url)
    store_port = int(pd.store_url.rsplit(":", 1)[1].split("/")[0])
    # P's write-through cannot finish, so P never publishes room 300; P's own lookup of the prompt's
    # blocks misses its deadline (the default 2 s) first, then P computes them and the CTM writes
    os.kill(redis, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as pool:
            d = pool.submit(httpx.post, f"{pd.decode.url}/generate", json=body, timeout=60)
            pool.submit(_post_quietly, f"{pd.prefill.url}/generate", body)
            deadline = time.monotonic() + 30
            while most_unread_bytes(store_port) < 1024:
                assert time.monotonic() < deadline, "P never started writing its blocks"
                time.sleep(0.02)
            kill_tree(pd.prefill, pids)
            killed = time.monotonic()
            r = d.result(timeout=30)
    finally:
        os.kill(redis, signal.SIGCONT)
    assert time.monotonic() - killed < 15  # D gives P 2 s to come back, not the request's deadline
    assert r.status_code == 502, r.text
    assert "unreachable" in r.json()["error"]["message"]

    assert_idle_and_clean(pd.decode)  # the request never entered D's engine
    # D serves on, and whatever of the prompt P left in the store is exact: D's answer without P equals
    # the colocated server's
    served, ref = _generate(pd.decode.url, prompt, 3), _generate(pd.colocated.url, prompt, 3)
    assert served.status_code == 200, served.text
    assert served.json()["output_ids"] == ref.json()["output_ids"]
    num_rows = len(prompt) + 3 - 1
    assert np.array_equal(_rows(served.json()["meta_info"], num_rows), _rows(ref.json()["meta_info"], num_rows))
    assert_swept(roles, pids)


def _post_quietly(url: str, body: dict) -> None:
    """P's side of the request: its server is killed under it, so no answer is expected."""
    try:
        httpx.post(url, json=body, timeout=60)
    except httpx.HTTPError:
        pass
