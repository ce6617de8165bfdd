"""/generate as slime, miles and sglang-router drive it, through the real server (fake GLM-4.5 with a dense
layer 0, R3 on, --enable-return-routed-experts): the request bodies recorded from their code
(tests/fixtures/rl_frameworks/generate_*.json) served and read back as they read them, every field's
behaviour, every refusal's message, and a request whose logits turn NaN failing alone.

The checkpoint's embedding row of EOS is NaN: a prompt holding EOS makes NaN logits, and no other request
ever feeds EOS to the model (none sets ignore_eos, so a sampled EOS ends its request before it is fed).
"""

from __future__ import annotations

import base64
import json
import math
import os
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from api_server_process import ServerHandle, api_server
from safetensors.torch import load_file, save_file

from fastdeploy_r3.client import decode_routed_experts

NUM_LAYERS, MOE_LAYER_IDS, TOP_K, VOCAB, EOS = 4, [1, 2, 3], 4, 512, 511
PROMPT = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38]
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "rl_frameworks")


@pytest.fixture(scope="module")
def server(fake_model_dir, tmp_path_factory) -> Iterator[ServerHandle]:
    model = str(tmp_path_factory.mktemp("nan-eos-glm4"))
    shutil.copytree(fake_model_dir("glm4_moe"), model, dirs_exist_ok=True)
    weights = load_file(os.path.join(model, "model.safetensors"))
    weights["model.embed_tokens.weight"][EOS] = float("nan")
    save_file(weights, os.path.join(model, "model.safetensors"), metadata={"format": "pt"})
    logs = str(tmp_path_factory.mktemp("logs"))
    with api_server(model, logs, "--routing-replay-config", '{"enable_routing_replay": true}', "--max-model-len",
                    "256", "--max-num-seqs", "4", "--enable-return-routed-experts", "--max-n", "4",
                    "--max-batch-size", "6") as handle:
        yield handle


def recorded(framework: str, name: str, prompt: list[int], max_new_tokens: int, **sampling: Any) -> dict:
    """A body as the framework sends it, with this test's prompt, length and sampling overrides."""
    with open(os.path.join(FIXTURES, f"generate_{framework}.json")) as f:
        body = json.load(f)["bodies"][name]
    body["input_ids"] = list(prompt)
    body["sampling_params"].update(max_new_tokens=max_new_tokens, **sampling)
    return body


def post(server: ServerHandle, body: dict, path: str = "/generate") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def int32s(meta: dict, key: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(meta[key]), dtype=np.int32)


def as_slime_reads(prompt: list[int], out: dict) -> tuple[list[int], list[float], np.ndarray | None]:
    """slime's Sample.append_response_tokens: tokens and float(logprob) from output_token_logprobs, R3
    reshaped to (len(tokens) - 1 - routed_experts_start_len, num_layers, topk)."""
    meta = out["meta_info"]
    tokens = prompt + [item[1] for item in meta["output_token_logprobs"]]
    log_probs = [float(item[0]) for item in meta["output_token_logprobs"]]
    if "routed_experts" not in meta:
        return tokens, log_probs, None
    start = int(meta.get("routed_experts_start_len", 0) or 0)
    return tokens, log_probs, int32s(meta, "routed_experts").reshape(len(tokens) - 1 - start, NUM_LAYERS, TOP_K)


def completion_rows(server: ServerHandle, prompt: list[int], num_tokens: int) -> tuple[list[int], np.ndarray]:
    c = post(server, {"prompt": prompt, "max_tokens": num_tokens, "temperature": 0}, "/v1/completions").json()
    choice = c["choices"][0]
    text_ids = post(server, {"input_ids": prompt, "sampling_params": {"max_new_tokens": num_tokens,
                                                                      "temperature": 0}}).json()["output_ids"]
    return text_ids, decode_routed_experts(choice["routed_experts"])


@pytest.mark.parametrize("framework,name", [("slime", "default"), ("slime", "deterministic_group_member"),
                                            ("slime", "partial_rollout_resume"), ("miles", "default_r3_on"),
                                            ("miles", "legacy_partial_rollout_resume"), ("miles", "default_r3_off")])
def test_recorded_bodies_read_as_the_frameworks_read_them(server: ServerHandle, framework: str, name: str) -> None:
    prompt = PROMPT + [40, 41, 42] if "resume" in name else PROMPT  # a resumed rollout sends prompt + response
    r = post(server, recorded(framework, name, prompt, 6, temperature=0.0))
    assert r.status_code == 200, r.text
    out = r.json()
    tokens, log_probs, r3 = as_slime_reads(prompt, out)
    meta = out["meta_info"]
    assert tokens[len(prompt):] == out["output_ids"] and len(log_probs) == len(out["output_ids"]) >= 1
    assert all(isinstance(lp, float) and lp <= 0.0 for lp in log_probs)
    assert meta["finish_reason"]["type"] in ("length", "stop") and meta["weight_version"] == "0"
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(prompt), len(out["output_ids"]))
    if name == "default_r3_off":  # return_routed_experts: false wins over --enable-return-routed-experts
        assert r3 is None
        return
    assert r3 is not None and r3.shape == (len(tokens) - 1, NUM_LAYERS, TOP_K)
    assert (r3[:, 0, :] == 255).all()  # the dense layer: uint8's no-route sentinel
    ids, rows = completion_rows(server, prompt, len(out["output_ids"]))
    assert ids == out["output_ids"] and np.array_equal(rows, r3[:, MOE_LAYER_IDS, :])


def test_top_p_replay_as_slime_reads_it(server: ServerHandle) -> None:
    body = recorded("slime", "top_p_replay", PROMPT, 8, sampling_seed=11)
    out = post(server, body).json()
    meta = out["meta_info"]
    ids, offsets = int32s(meta, "top_p_token_ids"), int32s(meta, "top_p_token_offsets")
    n = len(out["output_ids"])
    assert offsets[0] == 0 and len(offsets) == n + 1 and offsets[-1] == len(ids)
    kept = [ids[offsets[i]:offsets[i + 1]] for i in range(n)]
    assert all(len(k) >= 1 and tok in k for k, tok in zip(kept, out["output_ids"]))
    # the same draw without replay: same tokens, and logprobs of the whole distribution, never larger
    del body["sampling_params"]["custom_params"]
    plain = post(server, body).json()
    assert plain["output_ids"] == out["output_ids"] and "top_p_token_ids" not in plain["meta_info"]
    for (renorm, _, _), (full, _, _) in zip(meta["output_token_logprobs"], plain["meta_info"]["output_token_logprobs"]):
        assert renorm >= full - 1e-6 and renorm <= 0.0


def test_streaming_as_slime_parses_it(server: ServerHandle) -> None:
    """slime's generate_streaming: every data line is JSON whose output_token_logprobs entries hold
    float(logprob) (it crashed on null), cumulative; the last one has the finish reason and R3."""
    body = recorded("slime", "streaming", PROMPT, 7, temperature=0.0, stream_interval=2)
    chunks = []
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=120) as r:
        for raw_line in r.iter_lines():
            if not raw_line or not raw_line.startswith("data:"):
                continue
            data = raw_line[len("data:"):].strip()
            if data and data != "[DONE]":
                chunks.append(json.loads(data))
    call_tokens, call_log_probs = [], []
    for chunk in chunks:
        meta = chunk["meta_info"]
        call_tokens = [item[1] for item in meta["output_token_logprobs"]]
        call_log_probs = [float(item[0]) for item in meta["output_token_logprobs"]]
        assert call_tokens == chunk["output_ids"]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert all(b - a >= 2 for a, b in zip(lengths[:-2], lengths[1:-1]))  # stream_interval 2
    assert all(c["meta_info"]["finish_reason"] is None and "routed_experts" not in c["meta_info"] for c in chunks[:-1])
    whole = post(server, {**body, "stream": False}).json()
    final = chunks[-1]
    assert call_tokens == whole["output_ids"] and final["text"] == whole["text"]
    assert call_log_probs == [lp for lp, _, _ in whole["meta_info"]["output_token_logprobs"]]
    assert all(c["meta_info"]["output_token_logprobs"] == final["meta_info"]["output_token_logprobs"][:n]
               for c, n in zip(chunks, lengths))
    assert final["meta_info"]["routed_experts"] == whole["meta_info"]["routed_experts"]
    assert final["meta_info"]["routed_experts_start_len"] == 0


def _counter(server: ServerHandle, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(f"fastdeploy_r3_server_{name}_total "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def test_sglang_router_fields_r3_without_asking_and_log_metrics(server: ServerHandle) -> None:
    """sglang-router 0.3.2 adds these to every body and drops return_routed_experts."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}, "model": "policy",
            "log_metrics": False, "no_logs": True, "return_hidden_states": False, "background": False,
            "return_bytes": False, "return_entropy": True, "return_indexer_topk": False, "stream": False}
    before = _counter(server, "generate_requests")
    out = post(server, body).json()
    assert _counter(server, "generate_requests") == before  # log_metrics: false
    meta = out["meta_info"]
    assert meta["routed_experts_start_len"] == 0
    assert int32s(meta, "routed_experts").size == (len(PROMPT) + len(out["output_ids"]) - 1) * NUM_LAYERS * TOP_K
    assert len(meta["output_token_entropy"]) == len(out["output_ids"])
    assert all(0.0 <= h <= math.log(VOCAB) for h in meta["output_token_entropy"])
    assert "output_token_logprobs" not in meta  # return_logprob was not asked for
    post(server, {**body, "log_metrics": True})
    assert _counter(server, "generate_requests") == before + 1
    info = httpx.get(f"{server.url}/get_server_info").json()
    assert (info["enable_return_routed_experts"], info["max_n"], info["max_batch_size"]) == (True, 4, 6)


def test_routed_experts_start_len_is_echoed_and_rows_start_there(server: ServerHandle) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
            "return_routed_experts": True, "return_logprob": True}
    whole = as_slime_reads(PROMPT, post(server, body).json())[2]
    later = post(server, {**body, "routed_experts_start_len": 5}).json()
    assert later["meta_info"]["routed_experts_start_len"] == 5
    assert np.array_equal(as_slime_reads(PROMPT, later)[2], whole[5:])


def test_no_stop_trim_keeps_the_matched_stop_string_and_token(server: ServerHandle) -> None:
    params = {"max_new_tokens": 12, "temperature": 0.0, "skip_special_tokens": False}
    base = post(server, {"input_ids": PROMPT, "sampling_params": params, "return_logprob": True,
                         "return_text_in_logprobs": True}).json()
    text, ids = base["text"], base["output_ids"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert len(text) >= 4 and stop.strip()
    cut = text.find(stop)
    trimmed = post(server, {"input_ids": PROMPT, "sampling_params": {**params, "stop": stop}}).json()
    kept = post(server, {"input_ids": PROMPT, "sampling_params": {**params, "stop": stop, "no_stop_trim": True}}).json()
    assert (trimmed["text"], kept["text"]) == (text[:cut], text[:cut + len(stop)])
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    texts = [entry[2] for entry in base["meta_info"]["output_token_logprobs"]]
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i] and texts[i])  # its first occurrence
    token_text = texts[k]
    by_token = {"input_ids": PROMPT, "sampling_params": {**params, "stop_token_ids": [ids[k]]}}
    trimmed, kept = post(server, by_token).json(), post(server, {**by_token, "sampling_params": {
        **by_token["sampling_params"], "no_stop_trim": True}}).json()
    assert trimmed["output_ids"] == kept["output_ids"] == ids[:k + 1]  # the stop token stays in output_ids
    assert kept["text"] == trimmed["text"] + token_text and kept["text"].startswith(trimmed["text"])


@pytest.mark.parametrize("change,message", [
    ({"return_hidden_states": True}, "return_hidden_states=True is not supported"),
    ({"return_indexer_topk": True}, "return_indexer_topk=True is not supported"),
    ({"return_bytes": True}, "return_bytes=True is not supported"),
    ({"background": True}, "background=True is not supported"),
    ({"sampling_params": {"custom_params": {"logit_scale": 2}}}, "custom_params.logit_scale is not supported"),
    ({"sampling_params": {"ignore_eos": "false"}}, "sampling_params.ignore_eos: Input should be a valid boolean"),
    ({"sampling_params": {"max_new_tokens": 2.5}}, "sampling_params.max_new_tokens: Input should be a valid integer"),
    ({"sampling_params": {"top_k": 2.5}}, "sampling_params.top_k: Input should be a valid integer"),
    ({"sampling_params": {"stop_token_ids": "a"}}, "sampling_params.stop_token_ids"),
    ({"sampling_params": {"stop_token_ids": [-1, 10**9]}}, "token ids are integers >= 0"),
    ({"sampling_params": {"stop_token_ids": [10**9]}}, "token id 1000000000 is outside the vocabulary [0, 512)"),
    ({"sampling_params": {"repetition_penalty": 1e-300}}, "repetition_penalty=1e-300; use a value in [0.01, 100]"),
    ({"sampling_params": {"stop": ["x"] * 200}}, "stop has 200 strings"),
    ({"sampling_params": {"n": 5}}, "n=5; this server serves at most 4 choices per prompt (--max-n)"),
    ({"input_ids": [PROMPT] * 7}, "the batch has 7 prompts; send at most 6"),
    ({"input_ids": [PROMPT] * 3, "sampling_params": {"n": 3}}, "the call asks for 9 choices"),
    ({"input_ids": [True, False]}, "input_ids"),
    ({"input_ids": [5, 10**9]}, "token id 1000000000 is outside the vocabulary [0, 512)"),
    ({"input_ids": [[5], [-1]]}, "token id -1 is outside the vocabulary"),
    ({"return_logprob": "yes"}, "return_logprob"),
    ({"stream": "true"}, "stream: Input should be a valid boolean"),
    ({"return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num=21; use a value in [0, 20]"),
    ({"return_routed_experts": "true"}, "return_routed_experts"),
])
def test_refusals_name_what_to_change(server: ServerHandle, change: dict, message: str) -> None:
    r = post(server, {"input_ids": PROMPT, **change})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("change,message", [
    ({"repetition_penalty": 1e-300}, "repetition_penalty=1e-300"),
    ({"ignore_eos": "false"}, "ignore_eos"),
    ({"stop_token_ids": [10**9]}, "outside the vocabulary"),
    ({"n": 5}, "--max-n"),
    ({"max_tokens": 2.5}, "max_tokens"),
])
def test_openai_fields_are_as_strict(server: ServerHandle, change: dict, message: str) -> None:
    r = post(server, {"prompt": PROMPT, "max_tokens": 2, **change}, "/v1/completions")
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_non_finite_logits_fail_that_request_alone(server: ServerHandle) -> None:
    """The prompt holding EOS (a NaN embedding) fails with a clear error while the request beside it is
    served exactly as alone; never a 200 with garbage, never a 500 after a whole generation."""
    good = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
    bad = {**good, "input_ids": PROMPT[:4] + [EOS] + PROMPT[4:]}
    alone = post(server, good).json()
    answers: dict[str, httpx.Response] = {}
    threads = [threading.Thread(target=lambda k=k, b=b: answers.__setitem__(k, post(server, b)))
               for k, b in (("good", good), ("bad", bad))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert answers["good"].status_code == 200 and answers["good"].json()["output_ids"] == alone["output_ids"]
    # the same tokens; their logprobs to float32 rounding: a step of two rows runs other GEMM shapes than a step
    # of one, which need not give the same bits (on AVX-512 CPUs they differ in the 7th digit); bits equal across
    # batch shapes are --enable-deterministic-inference's promise (tests/engine/test_deterministic.py)
    got = answers["good"].json()["meta_info"]["output_token_logprobs"]
    want = alone["meta_info"]["output_token_logprobs"]
    assert [e[1:] for e in got] == [e[1:] for e in want]
    assert [e[0] for e in got] == pytest.approx([e[0] for e in want], abs=1e-5)
    assert answers["bad"].status_code == 500
    message = answers["bad"].json()["error"]["message"]
    assert "NonFiniteLogitsError" in message and "Traceback" not in message
    c = post(server, {"prompt": bad["input_ids"], "max_tokens": 2, "logprobs": 1}, "/v1/completions")
    assert c.status_code == 500 and "NonFiniteLogitsError" in c.json()["error"]["message"]
    assert post(server, good).json()["output_ids"] == alone["output_ids"]  # and the server serves on
