"""Verify steps replayed in CUDA graphs (worker/cuda_graph_runner.py, query length k + 1) give the eager
verify step's tokens and R3 rows. CI has no GPU: tests/gpu/conftest.py skips this there; through the
device tool (an H200):

    python -m pytest -m gpu tests/gpu/test_verify_graphs_cuda.py -v -s

Tiny qwen3_moe in float32, block size 4: three requests verify 3, 1 and 0 drafts (the first draft of each
is the greedy token, so rows past the first sample too), once eagerly and once through the graph of 4
requests x 4 slots. tests/worker/test_verify_graph_layout.py checks the same layout on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from step_bench import StepBench

from fastdeploy_r3.worker.messages import ScheduledRequestData

pytestmark = pytest.mark.gpu


def test_a_verify_step_in_a_cuda_graph_equals_the_eager_one(fake_model_dir) -> None:  # noqa: ANN001
    sb = StepBench(fake_model_dir("qwen3_moe"), "cuda", "float32", "auto", 4, 64, 64, 4, 256, False)
    try:
        sb.runner.capture_decode_graphs(verify_query_len=4)
        graphs = sb.runner.decode_graphs
        assert graphs is not None and 4 in graphs.query_sizes
        rng = np.random.default_rng(7)
        sb.prefill([rng.integers(3, 500, n).tolist() for n in (9, 13, 6)], reserve=8)
        last = dict(sb.last_tokens)

        def verify_step(drafts: dict[str, list[int]]) -> list[ScheduledRequestData]:
            return [ScheduledRequestData(rid, [last[rid]] + drafts[rid], pos, table, [1] * len(table),
                                         sample=True, num_sample_rows=1 + len(drafts[rid]))
                    for rid, table, pos in sb.requests]  # fmt: skip

        greedy = sb._step(verify_step({"r0": [], "r1": [], "r2": []}))  # a decode step: the q = 1 graph
        step = verify_step({"r0": [greedy["r0"][0], 12, 13], "r1": [greedy["r1"][0]], "r2": []})
        slots = [r.block_table[p // 4] * 4 + p % 4
                 for r in step for p in range(r.start_pos, r.start_pos + len(r.token_ids))]  # fmt: skip
        sb.runner.decode_graphs = None
        want_tokens = sb._step(step)  # eager: the packed layout
        want_rows = sb.routing_host.rows[slots].copy()
        sb.routing_host.rows[slots] = 0
        sb.runner.decode_graphs = graphs
        got_tokens = sb._step(step)
        print(f"\nreplays by query length: {graphs.replays}; tokens {got_tokens}")
        assert graphs.replays[4] == 1 and graphs.replays[1] == 1
        assert got_tokens == want_tokens
        assert len(got_tokens["r0"]) >= 2 and len(got_tokens["r1"]) == 2 and len(got_tokens["r2"]) == 1
        assert (want_rows != 255).all()
        assert np.array_equal(sb.routing_host.rows[slots], want_rows)
    finally:
        sb.close()
