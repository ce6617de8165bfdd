"""Verify steps replayed in CUDA graphs (worker/cuda_graph_runner.py, query length k + 1) give the eager
verify step's tokens and R3 rows. CI has no GPU: tests/gpu/conftest.py skips this there; through the
device tool (an H200):

    python -m pytest -m gpu tests/gpu/test_verify_graphs_cuda.py -v -s

Tiny qwen3_moe in float32, block size 4: three requests verify 3, 1 and 0 drafts (the first draft of each
is the greedy token, so rows past the first sample too), or 3 each (the rows fill the graph's slots),
once eagerly and once through the graph of 4 requests x 4 slots. tests/worker/test_verify_graph_layout.py
checks the same layout on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from step_bench import StepBench
from verify_graph_cases import assert_accepted_lengths, verify_step_after_prefill

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("full", [False, True])
def test_a_verify_step_in_a_cuda_graph_equals_the_eager_one(fake_model_dir, full: bool) -> None:  # noqa: ANN001
    sb = StepBench(fake_model_dir("qwen3_moe"), "cuda", "float32", "auto", 4, 64, 64, 4, 256, False)
    try:
        sb.runner.capture_decode_graphs(verify_query_len=4)
        graphs = sb.runner.decode_graphs
        assert graphs is not None and 4 in graphs.query_sizes
        step, slots = verify_step_after_prefill(sb, full)  # its probe decode step replays the q = 1 graph
        sb.runner.decode_graphs = None
        want_tokens = sb._step(step)  # eager: the packed layout
        want_rows = sb.routing_host.rows[slots].copy()
        sb.routing_host.rows[slots] = 0
        sb.runner.decode_graphs = graphs
        got_tokens = sb._step(step)
        print(f"\nreplays by query length: {graphs.replays}; tokens {got_tokens}")
        assert graphs.replays[4] == 1 and graphs.replays[1] == 1
        assert got_tokens == want_tokens
        assert_accepted_lengths(got_tokens, full)
        assert (want_rows != 255).all()
        assert np.array_equal(sb.routing_host.rows[slots], want_rows)
    finally:
        sb.close()
