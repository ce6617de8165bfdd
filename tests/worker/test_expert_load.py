"""Expert load recording (SGLang's expert distribution record) counts what the router routed: per MoE
layer and LOGICAL expert, the (token, k) rows of every forward pass between start and stop. The R3 rows
of the same requests ARE that routing, so the counts must equal their bincount exactly: through an
offline engine at EP=2 (two gloo worker ranks, which must agree) and through the real server's
/start_, /stop_ and /dump_expert_distribution_record (GLM with a dense layer 0, so the MoE layers are
not the model's layers; EP=2 with 2 redundant slots), whose record then feeds /rebalance_experts: the
recorded hottest expert gets a replica and the same requests give the same tokens and R3 rows after it.

No prefix caching: a cached prefix is not forwarded again, while its R3 rows are still returned.
"""

from __future__ import annotations

import base64
import glob
import os
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
from api_server_process import ServerHandle, api_server

from fastdeploy_r3 import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]]
NUM_EXPERTS = 16  # the tiny fakes' routed experts


def bincount(rows: list[np.ndarray]) -> np.ndarray:
    """[L, E]: how often each logical expert appears in each MoE layer of R3 rows [n, L, K]."""
    stacked = np.concatenate(rows)  # [sum n, L, K]
    return np.stack([np.bincount(stacked[:, layer].reshape(-1), minlength=NUM_EXPERTS)
                     for layer in range(stacked.shape[1])])


def test_engine_counts_equal_the_r3_rows_of_the_recorded_requests(fake_model_dir) -> None:
    with LLM(fake_model_dir("qwen3_moe"), tensor_parallel_size=2, enable_expert_parallel=True, block_size=4,
             enable_prefix_caching=False, routing_replay_config={"enable_routing_replay": True}) as llm:
        llm.generate([[3, 4, 5, 6]], GREEDY, use_tqdm=False)  # before the start: not counted
        llm.start_expert_distribution_record()
        assert np.count_nonzero(llm.dump_expert_distribution_record()) == 0  # the start forgot nothing yet
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.stop_expert_distribution_record()
        llm.generate([[200, 201, 202]], GREEDY, use_tqdm=False)  # after the stop: not counted
        counts = np.array(llm.dump_expert_distribution_record())
        llm.start_expert_distribution_record()  # a new start resets the record
        again = np.array(llm.dump_expert_distribution_record())
    rows = [o.outputs[0].routed_experts for o in outs]
    assert [len(r) for r in rows] == [len(p) + GREEDY.max_tokens - 1 for p in PROMPTS]
    want = bincount(rows)
    assert counts.shape == want.shape == (4, NUM_EXPERTS)  # 4 MoE layers, logical experts (both ranks' halves)
    assert np.array_equal(counts, want)
    assert counts.sum() == sum(len(r) for r in rows) * 4 * 4  # every (token, k) row once a layer: 4 layers, top-4
    assert np.count_nonzero(again) == 0


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("expert-record"))


@pytest.fixture(scope="module")
def server(fake_model_dir, tmp_path_factory, record_dir) -> Iterator[ServerHandle]:
    """EP=2 with 2 redundant slots: the record and the rebalance it feeds, through HTTP."""
    logs = str(tmp_path_factory.mktemp("logs"))
    os.environ["SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"] = record_dir  # the server process inherits it
    try:
        with api_server(fake_model_dir("glm4_moe"), logs, "--routing-replay-config", '{"enable_routing_replay": true}',
                        "--max-model-len", "128", "--no-enable-prefix-caching", "--tensor-parallel-size", "2",
                        "--enable-expert-parallel", "--ep-num-redundant-experts", "2") as handle:
            yield handle
    finally:
        del os.environ["SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"]


def _generate(server: ServerHandle) -> tuple[list[list[int]], list[np.ndarray]]:
    tokens, rows = [], []
    for prompt in PROMPTS:
        out = httpx.post(f"{server.url}/generate", timeout=120, json={
            "input_ids": prompt, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}).json()
        tokens.append(out["output_ids"])
        flat = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
        rows.append(flat.reshape(len(prompt) + 4, 4, 4)[:, 1:])  # [n, layers 1..3 (MoE), K]: layer 0 is dense
    return tokens, rows


def test_server_dump_equals_the_r3_rows_and_feeds_a_rebalance(server: ServerHandle, record_dir: str) -> None:
    def call(path: str, method: str = "POST") -> str:
        r = httpx.request(method, f"{server.url}/{path}_expert_distribution_record", timeout=60)
        assert r.status_code == 200, r.text
        return r.text

    def rebalance() -> httpx.Response:
        return httpx.post(f"{server.url}/rebalance_experts", timeout=120)

    refused = rebalance()  # nothing recorded yet: nothing to balance by
    assert refused.status_code == 409 and "no expert load is recorded" in refused.json()["message"], refused.text
    assert call("start") == "Start recording the expert distribution.\n"
    tokens, rows = _generate(server)
    assert call("stop", "GET") == "Stop recording the expert distribution.\n"
    assert call("dump") == "Dump expert distribution record.\n"
    [path] = glob.glob(os.path.join(record_dir, "expert_distribution_recorder_*.pt"))
    record = torch.load(path)
    assert record["rank"] == 0
    assert record["logical_count"].dtype == torch.int64
    counts = record["logical_count"].numpy()
    assert np.array_equal(counts, bincount(rows))

    r = rebalance()
    assert r.status_code == 200 and r.json()["success"], r.text
    p2l = r.json()["physical_to_logical"]
    assert len(p2l) == 18 and sorted(set(p2l)) == list(range(NUM_EXPERTS))
    assert p2l.count(int(np.argmax(counts.sum(axis=0)))) >= 2  # the recorded hottest expert is replicated
    again_tokens, again_rows = _generate(server)  # no prefix cache: every token recomputed on the new slots
    assert again_tokens == tokens
    assert all(np.array_equal(a, b) for a, b in zip(again_rows, rows, strict=True))


def test_padded_tokens_and_a_stopped_record_count_nothing(fake_model_dir) -> None:
    """The add a CUDA graph replays runs whether or not a record is on: the device flag, not Python, gates it,
    and padding rows (slot_mapping < 0) never count."""
    from fastdeploy_r3.config import ModelConfig
    from fastdeploy_r3.model_executor.model_loader import load_model

    model = load_model(ModelConfig(model=fake_model_dir("qwen3_moe")), torch.device("cpu"))
    rec = model.expert_load
    ids = torch.tensor([[0, 3], [3, 5], [7, 7]])  # [T=3, K=2]; the last token is padding
    pad = torch.tensor([4, 9, -1])
    rec.start()
    rec.count(rec.counts[1], ids, pad)
    rec.flag.fill_(0)  # as a graph replayed after stop() runs the add: the device flag is 0, nothing counts
    rec.count(rec.counts[1], ids, None)
    want = torch.zeros(rec.num_layers, NUM_EXPERTS, dtype=torch.int64)
    want[1, 0], want[1, 3], want[1, 5] = 1, 2, 1
    assert torch.equal(rec.counts, want)
    assert rec.dump() == want.tolist()
