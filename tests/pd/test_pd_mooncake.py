"""Prefill/decode disaggregation with the mooncake transfer backend: P, D, a colocated server and the
registry's sglang-router as real processes; P and D each keep their own file store, so the prompt's
blocks reach D only over Mooncake Transfer Engine (TCP on loopback): P writes each block's KV slices
and R3 rows straight into the blocks D's engine reserved as it admitted the request (D is a CPU
engine: cache_manager/pd_receive.py, entrypoints/pd/te_in_place.py), never through D's store.

What must hold (docs/pd.md): greedy tokens and R3 rows through PD equal the colocated server's, P + N - 1
rows, with shared prefixes, chunked prefill and preemption on D, /generate and /v1/completions, streamed
or not; D never recomputes a block that arrived (cached_tokens); a block corrupted on P's side costs D
recomputation (D's check of what landed refuses it), never exactness; a closed bootstrap port is a 502;
the books of both are clean after.
R3 in debug mode through this backend: tests/pd/test_pd_mooncake_debug.py.
"""

from __future__ import annotations

import base64
import glob
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from api_server_process import free_port
from pd_deployment import (
    Deployment,
    assert_idle_and_clean,
    assert_swept,
    generate_greedy,
    kill_tree,
    pd_deployment,
    server_tree,
)

from fastdeploy_r3.client import decode_routed_experts

NUM_LAYERS, TOP_K = 4, 4  # the fake glm4_moe
BLOCK = 4
D_BLOCKS = 12
R3_ON = '{"enable_routing_replay": true}'
PREFIX = [30 + i for i in range(8)]  # two full blocks shared, then tails of other lengths
PROMPTS = [PREFIX + [60 + i for i in range(k)] for k in (0, 3, 5)]


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("pd_te_logs"))


@pytest.fixture(scope="module")
def pd(fake_model_dir, logs) -> Iterator[Deployment]:
    common = ("--routing-replay-config", R3_ON, "--enable-return-routed-experts", "--max-model-len", "48",
              "--block-size", str(BLOCK), "--max-num-batched-tokens", "8")
    with pd_deployment(fake_model_dir("glm4_moe"), logs, common, ("--num-gpu-blocks-override", str(D_BLOCKS)),
                       backend="mooncake") as deployment:
        yield deployment


def _rows(out: dict, num_rows: int) -> np.ndarray:
    rows = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
    return rows.reshape(num_rows, NUM_LAYERS, TOP_K)


def _blobs(logs: str, side: str) -> list[str]:
    return sorted(p for p in glob.glob(os.path.join(logs, f"{side}_store", "**", "*"), recursive=True)
                  if os.path.isfile(p))


def _generate(url: str, prompt: list[int], max_new_tokens: int = 5, stream: bool = False) -> dict:
    return generate_greedy(url, prompt, max_new_tokens, stream)


def _same(out: dict, ref: dict, prompt: list[int], n: int) -> None:
    assert out["output_ids"] == ref["output_ids"] and len(out["output_ids"]) == n
    assert np.array_equal(_rows(out, len(prompt) + n - 1), _rows(ref, len(prompt) + n - 1))


def test_both_servers_advertise_the_mooncake_backend(pd: Deployment) -> None:
    infos = [httpx.get(f"{s.url}/get_server_info", timeout=30).json() for s in (pd.prefill, pd.decode)]
    assert [(i["disaggregation_mode"], i["disaggregation_transfer_backend"]) for i in infos] == [
        ("prefill", "mooncake"), ("decode", "mooncake")]
    # D's cache transfer manager readies its transfer engine as it starts (in the background), not at the
    # first transfer; P's never does
    deadline = time.monotonic() + 30
    while "ready for prefill servers' writes" not in open(pd.decode.log_path).read():
        assert time.monotonic() < deadline, "D's CTM never readied its transfer engine"
        time.sleep(0.1)
    assert "ready for prefill servers' writes" not in open(pd.prefill.log_path).read()


def test_generate_equals_colocated_and_d_computes_none_of_the_blocks_that_arrived(pd: Deployment, logs) -> None:
    for stream in (False, True):
        for prompt in PROMPTS:
            out = _generate(pd.router, prompt, stream=stream)
            _same(out, _generate(pd.colocated.url, prompt), prompt, 5)
            if not stream:  # D's GPU cache serves the streamed repeats; the first time, the blocks arrived
                # every prompt token, the partial last block's too: D computes from P's first token on
                assert out["meta_info"]["cached_tokens"] == len(prompt)
    # the full prompt blocks crossed into D's engine blocks, not through its store: D's store holds only
    # blocks D computed (they end in output tokens), none of P's
    p_blocks, d_blocks = ({os.path.basename(b) for b in _blobs(logs, side)} for side in ("p", "d"))
    assert len(p_blocks) >= 2 + 1 and not p_blocks & d_blocks


def test_requests_in_flight_together_preempt_each_other_on_d_and_still_equal_colocated(pd: Deployment) -> None:
    # no shared prefix: 3 blocks each as D admits it, 10 once decoded (10 + 30 - 1 positions), and D holds
    # 12, so any two of them running on D at once preempt one another. With 14 tokens (6 blocks each, D
    # holding 10) only two arriving within a few steps of each other did, and a busy CI machine once
    # handed them over further apart than that
    prompts = [[100 + 20 * i + j for j in range(10)] for i in range(3)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: _generate(pd.router, p, 30), prompts))
    for prompt, out in zip(prompts, answers, strict=True):
        _same(out, _generate(pd.colocated.url, prompt, 30), prompt, 30)
    metrics = httpx.get(f"{pd.decode.url}/metrics", timeout=30).text
    preempted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("fastdeploy_r3_engine_preemptions"))
    assert preempted > 0, "D never preempted: the test no longer covers preemption"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_equal_colocated(pd: Deployment, stream: bool) -> None:
    model = httpx.get(f"{pd.colocated.url}/v1/models", timeout=30).json()["data"][0]["id"]
    prompt = f"the quick brown fox jumps over the {'lazy' if stream else 'sleepy'} dog"

    def ask(url: str) -> tuple[str, str]:
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        if not stream:
            c = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
            return c["text"], c["routed_experts"]
        text, routed = "", None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for c in json.loads(line[len("data: "):])["choices"]:
                        text, routed = text + (c.get("text") or ""), c.get("routed_experts") or routed
        return text, routed

    (text, routed), (ref_text, ref_routed) = ask(pd.router), ask(pd.colocated.url)
    assert text == ref_text
    assert np.array_equal(decode_routed_experts(routed), decode_routed_experts(ref_routed))


def test_a_room_d_needs_none_of_is_handed_back_to_p(pd: Deployment) -> None:
    """D's GPU pool holds the prompt's blocks (the router's request just before): D's engine asks P for
    none of room 4343's, and D hands the room back once its engine admitted the request, so that P's
    outbox keeps no room nobody will pull (it would push out rooms others still need)."""
    prompt = [500 + i for i in range(8)]  # whole blocks: D needs no partial one either
    _generate(pd.router, prompt)
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap_port, "bootstrap_room": 4343}
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
    assert httpx.post(f"{pd.prefill.url}/generate", json={**body, **boot}, timeout=120).status_code == 200
    manifest = f"http://127.0.0.1:{pd.bootstrap_port}/pd/rooms/4343/manifest"
    assert len(httpx.get(manifest, timeout=30).json()["block_digests"]) == 2  # P holds the room for D
    out = httpx.post(f"{pd.decode.url}/generate", json={**body, **boot}, timeout=120).json()
    assert out["meta_info"]["cached_tokens"] == 8 and len(out["output_ids"]) == 3
    deadline = time.monotonic() + 10
    while httpx.get(manifest, timeout=30).status_code == 200:  # handed back in the background
        assert time.monotonic() < deadline, "D never handed room 4343 back"
        time.sleep(0.05)
    assert httpx.get(manifest, timeout=30).status_code == 404


def _flip_a_byte(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))


def _prefill_alone(pd: Deployment, logs: str, prompt: list[int], room: int) -> list[str]:
    """P alone under a room of its own: it answers once the prompt's blocks are in its store; the blobs it
    stored, in the room's order (each file ends with its blob's trailer, which the manifest lists)."""
    before = set(_blobs(logs, "p"))
    r = httpx.post(f"{pd.prefill.url}/generate", timeout=120, json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        "bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap_port, "bootstrap_room": room})
    assert r.status_code == 200, r.text
    digests = httpx.get(f"http://127.0.0.1:{pd.bootstrap_port}/pd/rooms/{room}/manifest", timeout=30).json()
    order = {d: i for i, d in enumerate(digests["block_digests"])}
    trailer = {path: int.from_bytes(open(path, "rb").read()[-8:], "little") for path in set(_blobs(logs, "p")) - before}
    assert sorted(order.get(t, -1) for t in trailer.values()) == list(range(len(order)))
    return sorted(trailer, key=lambda path: order[trailer[path]])


def test_a_block_corrupted_on_p_costs_d_recomputation_never_exactness(pd: Deployment, logs) -> None:
    prompt = [200 + i for i in range(9)]
    new = _prefill_alone(pd, logs, prompt, 4242)
    assert len(new) == 3  # two full blocks and the partial last one (1 token)
    for path in new:  # a flipped byte in each: P sends them as stored, D's load refuses them and computes
        _flip_a_byte(path)
    out = _generate(pd.router, prompt)
    _same(out, _generate(pd.colocated.url, prompt), prompt, 5)
    assert out["meta_info"]["cached_tokens"] == 0


def test_a_partial_last_block_corrupted_on_p_costs_d_only_its_tokens(pd: Deployment, logs) -> None:
    prompt = [250 + i for i in range(11)]
    new = _prefill_alone(pd, logs, prompt, 4244)
    assert len(new) == 3  # two full blocks, then the partial last one (3 tokens), stored as the request ended
    _flip_a_byte(new[-1])
    out = _generate(pd.router, prompt)
    _same(out, _generate(pd.colocated.url, prompt), prompt, 5)
    assert out["meta_info"]["cached_tokens"] == 8  # the full blocks arrived; D computed the last 3 tokens


def test_a_transfer_that_fails_after_the_handoff_costs_d_recomputation_never_exactness(pd: Deployment) -> None:
    """P handed room 88 over, but its blocks are gone before D asks (here: another target took them, as a
    D that died mid-pull would have): D's pull fails, D computes the whole prompt, the answer is exact."""
    prompt = [400 + i for i in range(9)]
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap_port, "bootstrap_room": 88}
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    assert httpx.post(f"{pd.prefill.url}/generate", json={**body, **boot}, timeout=120).status_code == 200
    bootstrap = f"http://127.0.0.1:{pd.bootstrap_port}/pd/rooms/88"
    manifest = httpx.get(f"{bootstrap}/manifest", timeout=30).json()
    assert (len(manifest["block_digests"]), manifest["tail_tokens"]) == (3, 1)  # two full blocks, then 1 token
    taken = httpx.post(f"{bootstrap}/kv", timeout=30, json={"room": 88, "segment": "127.0.0.1:1", "first": 0,
                                                             "blocks": []})
    assert taken.json() == {"room": 88, "num_written": 0, "error": None}
    out = httpx.post(f"{pd.decode.url}/generate", json={**body, **boot}, timeout=120).json()
    _same(out, _generate(pd.colocated.url, prompt), prompt, 5)
    assert out["meta_info"]["cached_tokens"] == 0


def test_a_closed_bootstrap_port_is_a_502_and_both_servers_end_clean(pd: Deployment) -> None:
    body = {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(), "bootstrap_room": 99}
    r = httpx.post(f"{pd.decode.url}/generate", json=body, timeout=60)
    assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
    for server in (pd.prefill, pd.decode):
        assert_idle_and_clean(server)


def test_p_killed_after_its_handoff_fails_d_clearly_and_leaves_nothing(pd: Deployment) -> None:
    """Last (P stays dead): P published room 77 and holds its blocks for D, then its whole tree is
    SIGKILLed before D asks: D answers 502 within seconds, its books and arena clean, it serves on, and
    nothing of P's tree (segments, IPC directories) survives the next start's sweep."""
    prompt = [300 + i for i in range(9)]
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap_port, "bootstrap_room": 77}
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
    assert httpx.post(f"{pd.prefill.url}/generate", json={**body, **boot}, timeout=120).status_code == 200
    roles, pids = server_tree(pd.prefill)
    kill_tree(pd.prefill, pids)
    r = httpx.post(f"{pd.decode.url}/generate", json={**body, **boot}, timeout=60)
    assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
    assert_idle_and_clean(pd.decode)
    plain = httpx.post(f"{pd.decode.url}/generate", json=body, timeout=120).json()
    assert plain["output_ids"] == _generate(pd.colocated.url, prompt, 3)["output_ids"]
    assert_swept(roles, pids)
