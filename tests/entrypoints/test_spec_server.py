"""Speculative decoding through the real server, started with SGLang's flags: /generate's meta_info
carries SGLang's spec fields, R3 has exactly P + N - 1 rows in place (debug mode: rows are positions),
and /metrics counts the drafts."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from api_server_process import ServerHandle, api_server

PROMPT = [9, 10, 11] * 5  # repeats: the n-gram drafter finds drafts in the prompt itself
R3_DEBUG = '{"enable_routing_replay": true, "debug_mode": true}'


@pytest.fixture(scope="module")
def server(fake_model_dir, tmp_path_factory) -> Iterator[ServerHandle]:
    logs = str(tmp_path_factory.mktemp("logs"))
    with api_server(fake_model_dir("qwen3_moe"), logs, "--routing-replay-config", R3_DEBUG, "--max-model-len", "128",
                    "--max-num-seqs", "2", "--block-size", "4", "--speculative-algorithm", "NGRAM",
                    "--speculative-num-draft-tokens", "4", "--speculative-ngram-max-match-window-size", "3") as handle:
        yield handle


def test_generate_reports_spec_fields_and_exact_rows(server: ServerHandle) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
            "return_routed_experts": True}
    r = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    n = len(out["output_ids"])
    assert n == meta["completion_tokens"] == 12
    assert 1 <= meta["spec_verify_ct"] <= n
    assert 0 < meta["spec_accept_token_num"] <= meta["spec_draft_token_num"] <= 3 * meta["spec_verify_ct"]
    # every step adds its accepted drafts and one token
    assert meta["spec_accept_token_num"] + meta["spec_verify_ct"] == n
    assert meta["spec_accept_length"] == pytest.approx(n / meta["spec_verify_ct"])
    rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(len(PROMPT) + n - 1, -1)
    assert np.array_equal(rows, np.broadcast_to(np.arange(len(PROMPT) + n - 1)[:, None] % 255, rows.shape))
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    drafted = [line for line in metrics.splitlines() if line.startswith("fastdeploy_r3_engine_spec_draft_tokens")]
    assert drafted and float(drafted[0].split()[-1]) == meta["spec_draft_token_num"]
