"""The mooncake transfer backend with R3 in debug mode (every row holds its position): a prefill and a
decode server as real processes, each with its own file store, requests posted to both at once as
sglang-router posts them (tests/pd/test_pd_mooncake.py drives the router itself). Through PD a
response's rows are exactly positions 0 .. P + N - 2, whether P computed the prompt or served it from
its own cache, with a partial or a full last block, and when P's first token ends the request.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from api_server_process import ServerHandle, api_servers, free_port
from pd_deployment import assert_idle_and_clean

NUM_LAYERS, TOP_K = 4, 4  # the fake glm4_moe
BLOCK = 4
PREFIX = [30 + i for i in range(8)]  # two full blocks shared by every prompt


@pytest.fixture(scope="module")
def debug_pd(fake_model_dir, tmp_path_factory) -> Iterator[tuple[ServerHandle, ServerHandle, int]]:
    """(P, D, P's bootstrap port): R3 in debug mode, mooncake backend, no router."""
    logs = str(tmp_path_factory.mktemp("pd_te_debug_logs"))
    common = ("--routing-replay-config", '{"enable_routing_replay": true, "debug_mode": true}',
              "--enable-return-routed-experts", "--max-model-len", "40", "--block-size", str(BLOCK),
              "--max-num-batched-tokens", "8", "--disaggregation-transfer-backend", "mooncake",
              "--disaggregation-te-arena-mb", "4")
    port = free_port()
    model = fake_model_dir("glm4_moe")
    with api_servers(logs, (model, *common, "--kv-storage", f"file://{logs}/p_store", "--disaggregation-mode",
                            "prefill", "--disaggregation-bootstrap-port", str(port)),
                     (model, *common, "--kv-storage", f"file://{logs}/d_store", "--disaggregation-mode",
                      "decode")) as (p, d):
        yield p, d, port


def test_rows_through_pd_are_exactly_the_positions_in_debug_mode(debug_pd) -> None:
    p, d_server, port = debug_pd
    p_url, d_url = p.url, d_server.url
    # P computes the first prompt; the second shares its two full blocks (P serves them from its own
    # cache, D receives them all the same); partial and full last blocks; a first token that ends it
    cases = [(PREFIX + [60, 61, 62], 5), (PREFIX + [70, 71, 72, 73], 4), (PREFIX + [80], 1)]
    for room, (prompt, n) in enumerate(cases, start=500):
        body = {"input_ids": prompt, "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room,
                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
        with ThreadPoolExecutor(2) as pool:  # at once, as the router posts them
            d = pool.submit(httpx.post, f"{d_url}/generate", json=body, timeout=60)
            assert httpx.post(f"{p_url}/generate", json=body, timeout=60).status_code == 200
            out = d.result().json()
        num_rows = len(prompt) + n - 1
        rows = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
        want = np.broadcast_to(np.arange(num_rows, dtype=np.int32)[:, None, None], (num_rows, NUM_LAYERS, TOP_K))
        want = want.copy()
        want[:, 0] = 255  # the fake model's dense layer 0: the uint8 sentinel
        assert np.array_equal(rows.reshape(num_rows, NUM_LAYERS, TOP_K), want)
        # P's partial last block arrives too, unless P's token ended the request: D then runs the prompt
        # alone, and its last token must be computed there (its logits are the step's)
        assert out["meta_info"]["cached_tokens"] == (len(prompt) if n > 1 else len(prompt) // BLOCK * BLOCK)
    for server in (p, d_server):  # books agree, nothing reserved on either side
        assert_idle_and_clean(server)
