"""Weight updates on a live server (fake Qwen3-MoE, GPU prefix cache + CPU tier + file storage tier):
from disk and from a trainer process over gloo. Afterwards greedy tokens and R3 equal a fresh engine
started on the new weights, the new version roots every cache (the counters show no hit of the old
one), and requests in flight follow their pause mode."""

from __future__ import annotations

import base64
import multiprocessing as mp
import threading
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from api_server_process import ServerHandle, api_server, free_port, stream_generate

from fastdeploy_r3.sampling_params import SamplingParams

NUM_LAYERS, TOP_K = 4, 4  # qwen3_moe tiny: every layer is MoE
PROMPT = list(range(40, 90))  # 50 tokens: three full 16-token blocks
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
COUNTERS = ("prefix_hit_blocks", "swap_in_blocks", "storage_load_blocks")


@pytest.fixture(scope="module")
def server(fake_model_dir, tmp_path_factory) -> Iterator[ServerHandle]:
    storage = tmp_path_factory.mktemp("kv_storage")
    logs = str(tmp_path_factory.mktemp("logs"))
    with api_server(fake_model_dir("qwen3_moe", seed=0), logs, "--routing-replay-config",
                    '{"enable_routing_replay": true}', "--max-model-len", "256", "--num-gpu-blocks-override", "64",
                    "--num-cpu-blocks-override", "32", "--kv-storage", f"file://{storage}") as handle:
        yield handle


def _generate(server: ServerHandle, **body) -> dict:
    r = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _rollout(server: ServerHandle) -> tuple[dict, np.ndarray]:
    out = _generate(server, input_ids=PROMPT, sampling_params=GREEDY, return_routed_experts=True)
    rows = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
    return out, rows.reshape(-1, NUM_LAYERS, TOP_K)


def _counters(server: ServerHandle, names: tuple[str, ...] = COUNTERS) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    return {name: values[f"fastdeploy_r3_engine_{name}_total"] for name in names}


_FRESH: dict[str, tuple[list[int], np.ndarray]] = {}


def _fresh_engine(model_dir: str) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and R3 of a fresh engine started on model_dir (one start per directory)."""
    from fastdeploy_r3.engine.llm import LLM

    if model_dir not in _FRESH:
        r3 = {"enable_routing_replay": True}
        with LLM(model_dir, device="cpu", max_model_len=256, routing_replay_config=r3) as llm:
            (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                  use_tqdm=False)
        _FRESH[model_dir] = (out.outputs[0].token_ids, out.outputs[0].routed_experts)
    return _FRESH[model_dir]


def _warm_old_version(server: ServerHandle) -> None:
    """Run PROMPT twice under the current weights: its blocks are cached (GPU, write-through storage)."""
    _rollout(server)
    out, _ = _rollout(server)
    assert out["meta_info"]["cached_tokens"] == 48


def _assert_new_version_serves_no_old_block(server: ServerHandle, model_dir: str, version: str) -> None:
    before = _counters(server)
    out, r3 = _rollout(server)
    assert out["meta_info"]["weight_version"] == version and out["meta_info"]["cached_tokens"] == 0
    assert _counters(server) == before  # no GPU hit, no swap-in, no storage load of the old version
    tokens, rows = _fresh_engine(model_dir)
    assert out["output_ids"] == tokens
    assert np.array_equal(r3, rows.astype(np.int32))
    openai_style = httpx.post(f"{server.url}/v1/completions", timeout=120,
                              json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0}).json()
    assert openai_style["weight_version"] == version


def test_update_from_disk(server: ServerHandle, fake_model_dir) -> None:
    new = fake_model_dir("qwen3_moe", seed=1)
    _warm_old_version(server)
    updates = _counters(server, ("weight_updates",))["weight_updates"]
    r = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": new, "weight_version": "disk-1"},
                   timeout=120)
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert _counters(server, ("weight_updates",))["weight_updates"] == updates + 1
    assert httpx.get(f"{server.url}/get_weight_version").json() == {"weight_version": "disk-1"}
    _assert_new_version_serves_no_old_block(server, new, "disk-1")


def _trainer(url: str, model_dir: str, port: int, q) -> None:
    from fastdeploy_r3.client.weight_sync import WeightSync
    from fastdeploy_r3.model_executor.model_loader import iter_safetensors, safetensors_files

    sync = WeightSync(url)
    try:
        sync.init_group(master_port=port, backend="gloo")
        answer = sync.push(iter_safetensors(safetensors_files(model_dir)), weight_version="dist-2")
        q.put(answer)
    finally:
        sync.close()


def test_update_from_a_trainer_over_gloo(server: ServerHandle, fake_model_dir) -> None:
    new = fake_model_dir("qwen3_moe", seed=2)
    _warm_old_version(server)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    trainer = ctx.Process(target=_trainer, args=(server.url, new, free_port(), q))
    trainer.start()
    answer = q.get(timeout=120)
    trainer.join(60)
    assert answer["success"] is True and trainer.exitcode == 0
    _assert_new_version_serves_no_old_block(server, new, "dist-2")


def test_every_tp_rank_takes_its_shard_of_a_broadcast(fake_model_dir, tmp_path) -> None:
    """Two TP ranks (their own gloo group) join the trainer's group as ranks 1 and 2 of 3."""
    new = fake_model_dir("qwen3_moe", seed=2)
    with api_server(fake_model_dir("qwen3_moe", seed=0), str(tmp_path), "--routing-replay-config",
                    '{"enable_routing_replay": true}', "--max-model-len", "256",
                    "--tensor-parallel-size", "2") as tp2:
        assert httpx.get(f"{tp2.url}/get_server_info").json()["tp_size"] == 2
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        trainer = ctx.Process(target=_trainer, args=(tp2.url, new, free_port(), q))
        trainer.start()
        answer = q.get(timeout=120)
        trainer.join(60)
        assert answer["success"] is True and trainer.exitcode == 0
        out, r3 = _rollout(tp2)
    tokens, rows = _fresh_engine(new)  # one rank, the same checkpoint: TP=2 gives the same bits
    assert out["meta_info"]["weight_version"] == "dist-2" and out["output_ids"] == tokens
    assert np.array_equal(r3, rows.astype(np.int32))


def _stream_until_first_token(server: ServerHandle) -> tuple[threading.Thread, list[dict]]:
    return stream_generate(server, {"input_ids": PROMPT, "return_routed_experts": True, "sampling_params": {
        "max_new_tokens": 60, "temperature": 0, "ignore_eos": True}})


def test_in_place_pause_finishes_under_the_new_weights_and_says_so(server: ServerHandle, fake_model_dir) -> None:
    old_version = httpx.get(f"{server.url}/get_weight_version").json()["weight_version"]
    t, chunks = _stream_until_first_token(server)
    httpx.post(f"{server.url}/pause_generation", json={"mode": "in_place"})
    r = httpx.post(f"{server.url}/update_weights_from_disk", timeout=120,
                   json={"model_path": fake_model_dir("qwen3_moe", seed=3), "weight_version": "in-place-3"})
    assert r.json()["success"] is True
    httpx.post(f"{server.url}/continue_generation", json={})
    t.join(120)
    meta = chunks[-1]["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["weight_version"] == "in-place-3"
    (first, second) = meta["weight_versions"]
    assert first["version"] == old_version and second == {"version": "in-place-3", "start": first["end"], "end": 60}
    assert 0 < first["end"] < 60 and meta["spans_weight_versions"] is True
    assert len(base64.b64decode(meta["routed_experts"])) == (len(PROMPT) + 59) * NUM_LAYERS * TOP_K * 4


def test_abort_all_requests_aborts_in_flight_requests(server: ServerHandle, fake_model_dir) -> None:
    t, chunks = _stream_until_first_token(server)
    r = httpx.post(f"{server.url}/update_weights_from_disk", timeout=120,
                   json={"model_path": fake_model_dir("qwen3_moe", seed=1), "weight_version": "abort-4",
                         "abort_all_requests": True})
    assert r.json()["success"] is True
    t.join(120)
    meta = chunks[-1]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and "routed_experts" not in meta
    assert meta["weight_versions"][-1]["version"] != "abort-4"


def test_a_bad_update_is_refused_and_changes_nothing(server: ServerHandle, fake_model_dir) -> None:
    version = httpx.get(f"{server.url}/get_weight_version").json()["weight_version"]
    before, _ = _rollout(server)
    r = httpx.post(f"{server.url}/update_weights_from_disk", timeout=120,
                   json={"model_path": fake_model_dir("mixtral"), "weight_version": "never"})
    assert r.status_code == 400 and r.json()["success"] is False
    assert "no weight changed" in r.json()["message"]
    assert httpx.get(f"{server.url}/get_weight_version").json()["weight_version"] == version
    again, _ = _rollout(server)
    assert again["output_ids"] == before["output_ids"]
    r = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": "/nonexistent", "weight_version": "x"})
    assert r.status_code == 400 and "not a directory" in r.json()["message"]
    r = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": fake_model_dir("qwen3_moe", seed=1),
                                                                   "weight_version": version})
    assert r.status_code == 200 and "nothing reloaded" in r.json()["message"]  # a re-syncing trainer: idempotent
    again, _ = _rollout(server)
    assert again["output_ids"] == before["output_ids"]
