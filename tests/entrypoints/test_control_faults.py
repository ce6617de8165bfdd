"""Control calls that fail, stall or are fed garbage never kill the server (the shared control server
of conftest.py: its worker deadline is longer than its stall watchdog, so every test that survives a
stalled control call also proves that the engine heartbeats through it)."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import httpx
import pytest
from api_server_process import ServerHandle, free_port
from broken_checkpoints import SECRET, broken_checkpoints

PROMPT = list(range(40, 90))
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(control_server: ServerHandle) -> ServerHandle:
    return control_server


def _post(server: ServerHandle, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def _tokens(server: ServerHandle) -> list[int]:
    r = _post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_every_broken_checkpoint_is_a_clear_400_and_the_old_weights_keep_serving(
        server: ServerHandle, fake_model_dir, tmp_path) -> None:
    before = _tokens(server)
    version = httpx.get(f"{server.url}/get_weight_version").json()["weight_version"]
    for defect, path in broken_checkpoints(fake_model_dir("qwen3_moe", seed=1), str(tmp_path)).items():
        r = _post(server, "/update_weights_from_disk", {"model_path": path, "weight_version": f"bad-{defect}"})
        body = r.json()
        assert r.status_code == 400 and body["success"] is False, (defect, r.text)
        assert "no weight changed" in body["message"], (defect, body)
        assert str(tmp_path) not in r.text and SECRET not in r.text and "Traceback" not in r.text, (defect, r.text)
        assert body["weight_version"] == version
    assert server.proc.poll() is None and _tokens(server) == before


def test_a_refused_update_does_not_abort_requests_in_flight(server: ServerHandle) -> None:
    result: dict = {}
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}
    assert _post(server, "/pause_generation", {"mode": "in_place"}).status_code == 200
    t = threading.Thread(target=lambda: result.update(r=_post(server, "/generate", body)), daemon=True)
    t.start()
    time.sleep(0.5)  # the request is held, paused
    r = _post(server, "/update_weights_from_disk", {"model_path": "/nonexistent", "abort_all_requests": True})
    assert r.status_code == 400 and "not a directory" in r.json()["message"]
    _post(server, "/continue_generation", {})
    t.join(120)
    assert result["r"].status_code == 200 and result["r"].json()["meta_info"]["finish_reason"]["type"] == "length"


def test_an_openai_request_the_engine_aborts_is_a_503_that_says_why_not_a_missing_r3(server: ServerHandle) -> None:
    result: dict = {}
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    assert _post(server, "/pause_generation", {"mode": "in_place"}).status_code == 200
    try:
        t = threading.Thread(target=lambda: result.update(r=_post(server, "/v1/completions", body)), daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.url}/v1/loads").json()["aggregate"]["num_total_reqs"] < 1:  # held, paused
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert _post(server, "/pause_generation", {"mode": "abort"}).status_code == 200
        t.join(60)
    finally:
        _post(server, "/continue_generation", {})
    r = result["r"]
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert "aborted by /pause_generation" in message and "no routed_experts" in message, message


def test_a_rendezvous_nobody_answers_ends_at_its_deadline_and_the_server_serves(
        server: ServerHandle, control_stall_s: float) -> None:
    before = _tokens(server)
    health: list[int] = []

    def probe() -> None:  # /health answers while the engine waits for the rendezvous, past the stall deadline
        time.sleep(control_stall_s + 1.5)
        health.append(httpx.get(f"{server.url}/health", timeout=10).status_code)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    start = time.monotonic()
    r = _post(server, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": free_port(),
                                                     "rank_offset": 1, "world_size": 2, "backend": "gloo"})
    t.join(30)
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert time.monotonic() - start < 60 and health == [200]
    assert server.proc.poll() is None and _tokens(server) == before


def _trainer_that_stops(url: str, model_dir: str, port: int, how: str) -> None:
    """Joins the group, announces every tensor, broadcasts three, then dies without a word or hangs."""
    import concurrent.futures

    import torch.distributed as dist

    from fastdeploy_r3.distributed.weight_update_group import init_weight_update_group
    from fastdeploy_r3.model_executor.model_loader import iter_safetensors, safetensors_files

    items = list(iter_safetensors(safetensors_files(model_dir)))
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.submit(httpx.post, f"{url}/init_weights_update_group", timeout=60, json={
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"})
    group = init_weight_update_group("127.0.0.1", port, 0, 2, "weight_update_group", "gloo")
    pool.submit(httpx.post, f"{url}/update_weights_from_distributed", timeout=60, json={
        "names": [n for n, _ in items], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in items],
        "shapes": [list(t.shape) for _, t in items], "weight_version": "never"})
    for _, tensor in items[:3]:
        dist.broadcast(tensor, src=0, group=group)
    time.sleep(0.5 if how == "dies" else 600)
    os._exit(0)


@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_a_trainer_that_stops_mid_broadcast_leaves_a_server_that_says_why_and_recovers(
        server: ServerHandle, fake_model_dir, how: str) -> None:
    ctx = mp.get_context("spawn")
    trainer = ctx.Process(target=_trainer_that_stops, args=(server.url, fake_model_dir("qwen3_moe", seed=1),
                                                            free_port(), how))
    trainer.start()
    if how == "dies":
        trainer.join(120)
    deadline = time.monotonic() + 90
    while "weights" not in (health := httpx.get(f"{server.url}/health", timeout=10).json()):
        assert time.monotonic() < deadline, health
        time.sleep(0.2)
    trainer.kill()  # a stalled one is still waiting; the server gave up on it at its deadline
    trainer.join(30)
    assert "mixed" in health["weights"]
    not_ready = httpx.get(f"{server.url}/ready", timeout=10)  # a router must stop sending it requests
    assert not_ready.status_code == 503 and "mixed" in not_ready.json()["weights"]
    refused = _post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert refused.status_code == 503 and "push a complete update" in refused.text
    new = fake_model_dir("qwen3_moe", seed=1)
    healed = _post(server, "/update_weights_from_disk", {"model_path": new, "weight_version": "healed"})
    assert healed.status_code == 200, healed.text
    assert "weights" not in httpx.get(f"{server.url}/health").json()
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200
    assert server.proc.poll() is None and len(_tokens(server)) == GREEDY["max_new_tokens"]
