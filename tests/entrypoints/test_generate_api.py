"""The SGLang-compatible native API of the real server (subprocess, fake GLM-4.5 with a dense layer 0):
/generate read exactly as slime reads it, batches, streaming, and the control endpoints an RL
framework calls between steps (flush, abort, pause in both modes, continue, model/server info)."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from api_server_process import ServerHandle, api_server

from fastdeploy_r3.client import decode_routed_experts

NUM_LAYERS, MOE_LAYER_IDS, TOP_K = 4, [1, 2, 3], 4  # glm4_moe tiny: first_k_dense_replace=1
R3_ON = '{"enable_routing_replay": true}'
PROMPT = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38]  # > one 16-token block


@pytest.fixture(scope="module")
def server(fake_model_dir, tmp_path_factory) -> Iterator[ServerHandle]:
    logs = str(tmp_path_factory.mktemp("logs"))
    with api_server(fake_model_dir("glm4_moe"), logs, "--routing-replay-config", R3_ON, "--max-model-len", "256",
                    "--max-num-seqs", "4") as handle:
        yield handle


def _generate(server: ServerHandle, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/generate", json=body, timeout=120)


def _slime_decode(prompt: list[int], out: dict) -> tuple[list[int], np.ndarray]:
    """slime's sglang_rollout: tokens from output_token_logprobs, R3 reshaped to (len(tokens) - 1, H, K)."""
    tokens = prompt + [item[1] for item in out["meta_info"]["output_token_logprobs"]]
    rows = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
    return tokens, rows.reshape(len(tokens) - 1, NUM_LAYERS, TOP_K)


def test_generate_read_as_slime_reads_it(server: ServerHandle) -> None:
    r = _generate(server, input_ids=PROMPT, sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
                  return_logprob=True, return_routed_experts=True)
    assert r.status_code == 200, r.text
    out = r.json()
    tokens, r3 = _slime_decode(PROMPT, out)
    meta = out["meta_info"]
    assert out["output_ids"] == tokens[len(PROMPT):] and len(out["output_ids"]) == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (len(PROMPT), 6, "0")
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 6}]
    assert r3.shape == (len(PROMPT) + 5, NUM_LAYERS, TOP_K)
    assert (r3[:, 0, :] == 255).all()  # the dense layer: uint8's no-route sentinel, widened
    assert (r3[:, MOE_LAYER_IDS, :] < 16).all()
    # the same rollout through the OpenAI API: the MoE rows are the same, bit for bit
    c = httpx.post(f"{server.url}/v1/completions", timeout=120,
                   json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}).json()
    assert np.array_equal(decode_routed_experts(c["choices"][0]["routed_experts"]), r3[:, MOE_LAYER_IDS, :])


def test_openai_all_layers_layout_and_weight_version(server: ServerHandle) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    moe = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    full = httpx.post(f"{server.url}/v1/completions", json={**body, "routing_layout": "all_layers"}, timeout=120).json()
    assert (moe["routing_layout"], full["routing_layout"]) == ("moe", "all_layers")
    assert moe["weight_version"] == full["weight_version"] == "0" and full["moe_layer_ids"] == MOE_LAYER_IDS
    rows = decode_routed_experts(full["choices"][0]["routed_experts"])
    assert rows.shape == (len(PROMPT) + 3, NUM_LAYERS, TOP_K) and (rows[:, 0, :] == 255).all()
    assert np.array_equal(rows[:, MOE_LAYER_IDS, :], decode_routed_experts(moe["choices"][0]["routed_experts"]))
    assert "weight_versions" not in full["choices"][0] or full["choices"][0]["weight_versions"] is None


def test_batches_n_and_routed_experts_start_len(server: ServerHandle) -> None:
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    outs = _generate(server, text=["hello world", "the quick brown fox"], sampling_params=params,
                     return_routed_experts=True, routed_experts_start_len=2).json()
    assert isinstance(outs, list) and len(outs) == 2
    for out in outs:
        meta = out["meta_info"]
        rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
        assert rows.size == (meta["prompt_tokens"] + 3 - 1 - 2) * NUM_LAYERS * TOP_K
        assert "output_token_logprobs" not in meta  # return_logprob was not asked for
    with_text = _generate(server, text="hello world", sampling_params=params, return_logprob=True,
                          return_text_in_logprobs=True).json()
    entries = with_text["meta_info"]["output_token_logprobs"]
    assert [tid for _, tid, _ in entries] == with_text["output_ids"] and all(isinstance(t, str) for *_, t in entries)
    two = _generate(server, input_ids=PROMPT, sampling_params={**params, "n": 2, "temperature": 1.0,
                                                               "sampling_seed": 5}).json()
    assert len(two) == 2 and all(len(o["output_ids"]) == 3 for o in two)
    assert all("routed_experts" not in o["meta_info"] for o in two)  # SGLang's default: not asked, not sent


def test_streaming_is_cumulative_and_ends_with_routed_experts(server: ServerHandle) -> None:
    body = {"input_ids": PROMPT, "stream": True, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    events = []
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 5
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert all("routed_experts" not in c["meta_info"] for c in chunks[:-1])
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    full = _generate(server, input_ids=PROMPT, return_routed_experts=True,
                     sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}).json()
    assert final["output_ids"] == full["output_ids"] and final["text"] == full["text"]
    assert final["meta_info"]["routed_experts"] == full["meta_info"]["routed_experts"]


def test_bad_requests_are_refused_by_name(server: ServerHandle) -> None:
    def error(r: httpx.Response) -> str:
        assert r.status_code == 400, r.text
        return r.json()["error"]["message"]

    assert "lora_path" in error(_generate(server, input_ids=PROMPT, lora_path="adapter"))
    assert "bogus" in error(_generate(server, input_ids=PROMPT, bogus=1))
    assert "text or input_ids" in error(_generate(server, text="x", input_ids=PROMPT))
    zero = _generate(server, input_ids=PROMPT, sampling_params={"max_new_tokens": 0})
    assert "sampling_params.max_new_tokens" in error(zero)
    assert "logprob_start_len" in error(_generate(server, input_ids=PROMPT, return_logprob=True, logprob_start_len=0))


def test_info_endpoints(server: ServerHandle) -> None:
    for path in ("/get_model_info", "/model_info"):
        info = httpx.get(f"{server.url}{path}").json()
        assert info["is_generation"] is True and info["weight_version"] == "0"
        assert (info["num_hidden_layers"], info["moe_layer_ids"], info["moe_top_k"]) == (NUM_LAYERS, MOE_LAYER_IDS,
                                                                                       TOP_K)
    port = int(server.url.rsplit(":", 1)[1])
    for path in ("/get_server_info", "/server_info"):  # slime tries /server_info, then /get_server_info
        srv = httpx.get(f"{server.url}{path}").json()
        assert srv["weight_version"] == "0" and srv["paused"] is False
        # the fields slime's and miles' external-engine checks compare, with this server's values
        assert {k: srv[k] for k in ("host", "port", "nnodes", "node_rank", "gpu_id_step", "base_gpu_id", "tp_size",
                                    "dp_size", "pp_size", "ep_size", "enable_memory_saver",
                                    "enable_return_routed_experts", "page_size", "context_length")} == {
            "host": "127.0.0.1", "port": port, "nnodes": 1, "node_rank": 0, "gpu_id_step": 1, "base_gpu_id": 0,
            "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "enable_memory_saver": False,
            "enable_return_routed_experts": True, "page_size": 16, "context_length": 256}
        assert srv["moe_a2a_backend"] == "none"  # SGLang's name for no all-to-all dispatch
    assert httpx.get(f"{server.url}/get_weight_version").json() == {"weight_version": "0"}


def test_loads_and_health_generate(server: ServerHandle) -> None:
    """slime's idle check reads /v1/loads?include=core after an abort; miles' start polls /health_generate."""
    loads = httpx.get(f"{server.url}/v1/loads", params={"include": "core"}).json()
    assert loads["dp_rank_count"] == 1 and len(loads["loads"]) == 1
    rank = loads["loads"][0]
    assert (rank["num_running_reqs"], rank["num_waiting_reqs"]) == (0, 0) and 0 < rank["max_total_num_tokens"]
    s = _Stream(server, "loaded", max_new_tokens=40)
    s.wait_for_tokens()
    assert httpx.get(f"{server.url}/v1/loads").json()["aggregate"]["num_total_reqs"] == 1
    s.final()
    assert httpx.get(f"{server.url}/health_generate", timeout=30).json() == {"status": "ok"}


def test_flush_cache_drops_prefix_hits(server: ServerHandle) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    _generate(server, **body)
    assert _generate(server, **body).json()["meta_info"]["cached_tokens"] == 16  # one full block
    assert httpx.post(f"{server.url}/flush_cache").json()["success"] is True
    assert _generate(server, **body).json()["meta_info"]["cached_tokens"] == 0


class _Stream:
    """A streaming /generate in a thread: its chunks as they arrive."""

    def __init__(self, server: ServerHandle, rid: str, max_new_tokens: int = 200) -> None:
        self.body = {"input_ids": PROMPT, "rid": rid, "stream": True, "return_routed_experts": True,
                     "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
        self.url = f"{server.url}/generate"
        self.chunks: list[dict] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.chunks.append(json.loads(line[len("data: "):]))

    def wait_for_tokens(self, n: int = 1, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.chunks or len(self.chunks[-1]["output_ids"]) < n:
            assert time.monotonic() < deadline and self.thread.is_alive(), "no tokens streamed"
            time.sleep(0.01)

    def final(self, timeout: float = 120) -> dict:
        self.thread.join(timeout)
        assert not self.thread.is_alive()
        return self.chunks[-1]


def test_abort_request_ends_a_stream_with_abort(server: ServerHandle) -> None:
    s = _Stream(server, "to-abort")
    s.wait_for_tokens()
    assert httpx.post(f"{server.url}/abort_request", json={"rid": "to-abort"}).status_code == 200
    final = s.final()
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(final["output_ids"]) < 200


def test_pause_abort_mode_aborts_in_flight_and_queues_new_requests(server: ServerHandle) -> None:
    s = _Stream(server, "paused-abort")
    s.wait_for_tokens()
    assert httpx.post(f"{server.url}/pause_generation", json={"mode": "abort"}).json()["success"] is True
    final = s.final()
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert "pause_generation" in final["meta_info"]["finish_reason"]["message"]
    later = threading.Thread(target=lambda: _generate(server, input_ids=PROMPT,
                                                      sampling_params={"max_new_tokens": 2}), daemon=True)
    later.start()
    time.sleep(0.5)
    assert later.is_alive()  # queued while paused
    assert httpx.get(f"{server.url}/get_server_info").json()["paused"] is True
    assert httpx.get(f"{server.url}/health", timeout=2).json() == {"status": "paused", "engine": "ok",
                                                                  "paused": "abort"}
    assert httpx.get(f"{server.url}/health_generate", timeout=2).json()["status"] == "paused"
    httpx.post(f"{server.url}/continue_generation", json={})
    later.join(60)
    assert not later.is_alive()


def test_pause_in_place_holds_requests_and_continue_finishes_them(server: ServerHandle) -> None:
    s = _Stream(server, "paused-in-place", max_new_tokens=40)
    s.wait_for_tokens()
    assert httpx.post(f"{server.url}/pause_generation", json={"mode": "in_place"}).json()["success"] is True
    time.sleep(0.3)  # a step in flight when the pause arrived may still stream
    held = len(s.chunks[-1]["output_ids"])
    time.sleep(0.7)
    assert len(s.chunks[-1]["output_ids"]) == held and held < 40
    httpx.post(f"{server.url}/continue_generation", json={})
    final = s.final()
    meta = final["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 40}
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 40}]
    assert len(base64.b64decode(meta["routed_experts"])) == (len(PROMPT) + 39) * NUM_LAYERS * TOP_K * 4
