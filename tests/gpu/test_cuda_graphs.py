"""Decode CUDA graphs give the tokens and R3 rows of eager decode, and padded rows never reach the host.

Tiny qwen3_moe, float32, block_size 4, one ModelRunner driven in-process (tools/step_bench.py): 3 prompts
of 9-14 tokens, then 6 decode steps of batch 3, replayed from the padded graph of size 4.
"""

from __future__ import annotations

import numpy as np
import pytest
from fake_model import make_fake_model

from fastdeploy_r3.cache_manager.routing_buffer import NO_TAG
from tools.step_bench import StepBench

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 9, 77, 3, 14, 200, 31, 8, 41], [7] * 12, [100 + i for i in range(14)]]


def run(model_dir: str, enforce_eager: bool) -> tuple[list[dict[str, int]], np.ndarray, np.ndarray, StepBench]:
    bench = StepBench(model_dir, "cuda", "float32", "auto", max_batch=4, max_len=32, num_blocks=40, block_size=4,
                      enforce_eager=enforce_eager)  # fmt: skip
    bench.prefill(PROMPTS, reserve=8)
    bench.decode([True] * 6)
    return bench.sampled, bench.routing_host.rows.copy(), bench.routing_host.tags.copy(), bench


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_fake_model("qwen3_moe", str(tmp_path_factory.mktemp("qwen3-tiny")), preset="tiny", seed=0)


def test_graph_decode_equals_eager_tokens_and_r3_rows(model_dir: str) -> None:
    tokens, rows, tags, bench = run(model_dir, enforce_eager=False)
    try:
        if bench.runner.decode_graphs is None:
            pytest.skip("the attention backend on this branch is not CUDA-graph safe: decode stays eager")
        assert bench.runner.decode_graphs.sizes == [1, 2, 4]
        used = {s for _, table, pos in bench.requests for s in range(table[0] * 4, table[0] * 4 + pos)}
    finally:
        bench.close()
    eager_tokens, eager_rows, eager_tags, eager = run(model_dir, enforce_eager=True)
    eager.close()
    assert tokens == eager_tokens
    assert np.array_equal(rows, eager_rows) and np.array_equal(tags, eager_tags)
    # exactly the forwarded tokens' slots were written (tag 1); the graph's padded 4th row wrote nothing
    assert set(np.nonzero(tags == 1)[0].tolist()) == used
    untouched = sorted(set(range(len(tags))) - used)
    assert (tags[untouched] == NO_TAG).all() and (rows[untouched] == np.iinfo(rows.dtype).max).all()
