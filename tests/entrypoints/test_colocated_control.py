"""Colocated training against a live server (fake Qwen3-MoE, GPU prefix cache only, CPU): weights
pushed by reference through /update_weights_from_tensor, memory released and resumed, requests
retracted and resumed, weight versions named and checked. After every weight change the greedy
tokens and R3 equal a fresh engine started on the new weights, and no cached block of the old
weights is hit."""

from __future__ import annotations

import base64
import threading

import httpx
import numpy as np
import pytest
from api_server_process import ServerHandle, stream_generate
from safetensors.torch import load_file

from fastdeploy_r3.client.tensor_transport import flattened_bucket, serialize, serialize_named_tensors
from fastdeploy_r3.sampling_params import SamplingParams

NUM_LAYERS, TOP_K = 4, 4
PROMPT = list(range(40, 90))  # 50 tokens: three full 16-token blocks
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(control_server: ServerHandle) -> ServerHandle:
    return control_server


def _post(server: ServerHandle, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body if body is not None else {}, timeout=120)


def _rollout(server: ServerHandle, prompt: list[int] = PROMPT, params: dict = GREEDY) -> tuple[dict, np.ndarray]:
    r = _post(server, "/generate", {"input_ids": prompt, "sampling_params": params, "return_routed_experts": True})
    assert r.status_code == 200, r.text
    out = r.json()
    rows = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
    return out, rows.reshape(-1, NUM_LAYERS, TOP_K)


_FRESH: dict[str, tuple[list[int], np.ndarray]] = {}


def _fresh_engine(model_dir: str) -> tuple[list[int], np.ndarray]:
    from fastdeploy_r3.engine.llm import LLM

    if model_dir not in _FRESH:
        with LLM(model_dir, device="cpu", max_model_len=256, routing_replay_config={"enable_routing_replay": True}) \
                as llm:
            (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                  use_tqdm=False)
        _FRESH[model_dir] = (out.outputs[0].token_ids, out.outputs[0].routed_experts)
    return _FRESH[model_dir]


def _assert_serves_fresh(server: ServerHandle, model_dir: str, version: str) -> None:
    """The new weights answer, from scratch: no cached block of the old ones, tokens and R3 of a fresh engine."""
    out, rows = _rollout(server)
    assert out["meta_info"]["weight_version"] == version and out["meta_info"]["cached_tokens"] == 0
    tokens, fresh_rows = _fresh_engine(model_dir)
    assert out["output_ids"] == tokens
    assert np.array_equal(rows, fresh_rows.astype(np.int32))


def _tensors(model_dir: str) -> list:
    return sorted(load_file(f"{model_dir}/model.safetensors").items())


def _weight_updates(server: ServerHandle) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("fastdeploy_r3_engine_weight_updates_total")]
    return float(line.split()[1])


def test_update_from_tensor_serves_the_new_weights_from_scratch(server: ServerHandle, fake_model_dir) -> None:
    _rollout(server)
    assert _rollout(server)[0]["meta_info"]["cached_tokens"] == 48  # the old weights' blocks are cached
    new = fake_model_dir("qwen3_moe", seed=1)
    tensors = _tensors(new)  # stays referenced until the server answered: its shared memory is what travels
    r = _post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [serialize_named_tensors(tensors)],
                                                      "weight_version": "tensor-1"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    _assert_serves_fresh(server, new, "tensor-1")


def test_a_flattened_bucket_as_slime_sends_it(server: ServerHandle, fake_model_dir) -> None:
    new = fake_model_dir("qwen3_moe", seed=2)
    bucket = flattened_bucket(_tensors(new))
    r = _post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [serialize(bucket)],
                                                      "load_format": "flattened_bucket", "weight_version": "bucket-2"})
    assert r.status_code == 200, r.text
    _assert_serves_fresh(server, new, "bucket-2")


def test_the_current_version_again_reloads_nothing_unless_forced(server: ServerHandle, fake_model_dir) -> None:
    """A whole checkpoint under the current name is idempotent; force reloads it from scratch."""
    model_dir = fake_model_dir("qwen3_moe", seed=1)
    r = _post(server, "/update_weights_from_disk", {"model_path": model_dir, "weight_version": "disk-1"})
    assert r.status_code == 200 and _rollout(server)[0]["meta_info"]["cached_tokens"] == 0
    before = _weight_updates(server)
    r = _post(server, "/update_weights_from_disk", {"model_path": model_dir, "weight_version": "disk-1"})
    assert r.status_code == 200 and "nothing reloaded" in r.json()["message"]
    assert _weight_updates(server) == before and _rollout(server)[0]["meta_info"]["cached_tokens"] == 48
    r = _post(server, "/update_weights_from_disk", {"model_path": model_dir, "weight_version": "disk-1",
                                                    "force": True})
    assert r.status_code == 200 and r.json()["weight_version"] == "disk-1"
    assert _weight_updates(server) == before + 1
    _assert_serves_fresh(server, model_dir, "disk-1")  # reloaded: nothing cached under the old root is hit


def test_buckets_of_one_version_each_load(server: ServerHandle, fake_model_dir) -> None:
    """slime pushes a version as many buckets, every one naming that version: each is loaded."""
    new = fake_model_dir("qwen3_moe", seed=2)
    tensors = _tensors(new)
    half = len(tensors) // 2
    for bucket in (tensors[:half], tensors[half:]):
        payload = [serialize(flattened_bucket(bucket))]
        r = _post(server, "/update_weights_from_tensor", {"serialized_named_tensors": payload,
                                                          "load_format": "flattened_bucket", "weight_version": "b-2"})
        assert r.status_code == 200 and r.json()["message"].startswith("weights updated"), r.text
    _assert_serves_fresh(server, new, "b-2")


def test_versions_without_a_name_come_from_a_counter(server: ServerHandle, fake_model_dir) -> None:
    r = _post(server, "/update_weight_version", {"new_version": "run1"})
    assert r.status_code == 200 and r.json()["weight_version"] == "run1"
    again = _post(server, "/update_weight_version", {"new_version": "run1"})
    assert again.json()["message"].endswith("nothing changed")
    tensors = _tensors(fake_model_dir("qwen3_moe", seed=1))
    names = []
    for _ in range(2):
        payload = [serialize_named_tensors(tensors)]
        r = _post(server, "/update_weights_from_tensor", {"serialized_named_tensors": payload})
        assert r.status_code == 200, r.text
        names.append(r.json()["weight_version"])
    assert names[0].isdigit() and names[1] == str(int(names[0]) + 1)  # never "run1+1+2"


def test_release_and_resume_memory_then_new_weights(server: ServerHandle, fake_model_dir) -> None:
    r = _post(server, "/release_memory_occupation", {"tags": None})
    assert r.status_code == 200 and "released kv_cache, weights" in r.json()["message"], r.text
    refused = _post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert refused.status_code == 503 and "resume_memory_occupation" in refused.text
    assert "memory" in httpx.get(f"{server.url}/health").json()
    assert _post(server, "/update_weights_from_tensor", {
        "serialized_named_tensors": [serialize_named_tensors(_tensors(fake_model_dir("qwen3_moe", seed=2)))]
    }).status_code == 409
    assert _post(server, "/resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
    assert _post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}).status_code == 503
    assert _post(server, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    missing = _post(server, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert missing.status_code == 503 and "push weights" in missing.text  # resumed weights hold no values
    new = fake_model_dir("qwen3_moe", seed=2)
    tensors = _tensors(new)
    r = _post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [serialize_named_tensors(tensors)],
                                                      "weight_version": "colocated-2"})
    assert r.status_code == 200, r.text
    _assert_serves_fresh(server, new, "colocated-2")


def test_kv_cache_alone_released_and_resumed_serves_the_same_weights(server: ServerHandle) -> None:
    before, rows = _rollout(server)
    assert _post(server, "/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert _post(server, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    after, again = _rollout(server)
    assert after["meta_info"]["cached_tokens"] == 0  # the cache came back empty
    assert after["output_ids"] == before["output_ids"] and np.array_equal(rows, again)


def _stream(server: ServerHandle, max_new_tokens: int) -> tuple[threading.Thread, list[dict]]:
    return stream_generate(server, {"input_ids": PROMPT, "return_routed_experts": True, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}})


def test_release_is_refused_while_requests_hold_the_cache(server: ServerHandle) -> None:
    t, _ = _stream(server, 60)
    assert _post(server, "/pause_generation", {"mode": "in_place"}).status_code == 200
    r = _post(server, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert r.status_code == 409 and "requests are in flight" in r.json()["message"]
    _post(server, "/continue_generation")
    t.join(120)


def test_retract_recomputes_under_the_new_weights_with_exact_rows(server: ServerHandle, fake_model_dir) -> None:
    old = httpx.get(f"{server.url}/get_weight_version").json()["weight_version"]
    t, chunks = _stream(server, 40)
    assert _post(server, "/pause_generation", {"mode": "retract"}).status_code == 200
    r = _post(server, "/update_weights_from_disk", {"model_path": fake_model_dir("qwen3_moe", seed=4),
                                                    "weight_version": "retract-4"})
    assert r.status_code == 200, r.text
    _post(server, "/continue_generation")
    t.join(120)
    meta = chunks[-1]["meta_info"]
    first, second = meta["weight_versions"]
    assert first["version"] == old and second == {"version": "retract-4", "start": first["end"], "end": 40}
    tokens = PROMPT + chunks[-1]["output_ids"]  # chunks are cumulative
    rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(-1, NUM_LAYERS, TOP_K)
    assert len(rows) == len(tokens) - 1
    # every row was recomputed by the new weights: the same tokens prefilled from scratch route the same
    _, replay = _rollout(server, tokens[:-1], {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True})
    assert np.array_equal(rows, replay)


def test_weights_checker_sees_every_update(server: ServerHandle, fake_model_dir) -> None:
    snap = _post(server, "/weights_checker", {"action": "snapshot"}).json()
    assert snap["success"] is True and len(snap["per_engine_checksum"]) == 64
    digests = snap["ranks"][0]["checksums"]
    assert "lm_head.weight" in digests and all(len(d) == 64 for d in digests.values())
    same = _post(server, "/weights_checker", {"action": "compare"}).json()
    assert same["success"] is True and same["mismatched"] == []
    tensors = _tensors(fake_model_dir("qwen3_moe", seed=1))  # the weights are seed 4's since the retract test
    payload = [serialize_named_tensors(tensors)]
    r = _post(server, "/update_weights_from_tensor", {"serialized_named_tensors": payload, "weight_version": "chk-5"})
    assert r.status_code == 200
    diff = _post(server, "/weights_checker", {"action": "compare"})
    assert diff.status_code == 200 and diff.json()["success"] is False and diff.json()["mismatched"]
    assert diff.json()["per_engine_checksum"] != snap["per_engine_checksum"]


def test_session_and_post_processing_calls_and_selectors(server: ServerHandle) -> None:
    assert _post(server, "/begin_weight_update", {"selector": "all"}).json()["success"] is True
    assert _post(server, "/end_weight_update").json()["success"] is True
    r = _post(server, "/post_process_weights", {"restore_weights_before_load": True})
    assert r.status_code == 200 and "no-op" in r.json()["message"]
    r = _post(server, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [],
                                                           "selector": "draft"})
    assert r.status_code == 400 and "selector 'draft'" in r.text
