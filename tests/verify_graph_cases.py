"""The verify step both verify-graph tests run (tests/worker/test_verify_graph_layout.py on the CPU,
tests/gpu/test_verify_graphs_cuda.py on an H200): three prompts prefilled in a StepBench (block size 4),
then one verify step where request 0 feeds 3 drafts (the first one its greedy token), request 1 one
draft (right) and request 2 none, so rows past the first sample too; or (full) every request 3 drafts,
its greedy token first, the step whose packed order is the graph's own."""

from __future__ import annotations

import numpy as np

from fastdeploy_r3.worker.messages import ScheduledRequestData


def verify_step_after_prefill(sb, full: bool = False) -> tuple[list[ScheduledRequestData], list[int]]:  # noqa: ANN001
    """Prefill, one greedy decode step as the probe (it runs whatever graphs are installed), then
    -> (the verify step, the KV slots of its tokens: where its R3 rows land)."""
    rng = np.random.default_rng(7)
    sb.prefill([rng.integers(3, 500, n).tolist() for n in (9, 13, 6)], reserve=8)
    last = dict(sb.last_tokens)

    def verify_step(drafts: dict[str, list[int]]) -> list[ScheduledRequestData]:
        return [ScheduledRequestData(rid, [last[rid]] + drafts[rid], pos, table, [1] * len(table),
                                     sample=True, num_sample_rows=1 + len(drafts[rid]))
                for rid, table, pos in sb.requests]  # fmt: skip

    greedy = sb._step(verify_step({"r0": [], "r1": [], "r2": []}))  # each request's next token
    if full:
        step = verify_step({rid: [greedy[rid][0], 12, 13] for rid in greedy})
    else:
        step = verify_step({"r0": [greedy["r0"][0], 12, 13], "r1": [greedy["r1"][0]], "r2": []})
    bs = sb.block_size
    slots = [r.block_table[p // bs] * bs + p % bs
             for r in step for p in range(r.start_pos, r.start_pos + len(r.token_ids))]  # fmt: skip
    return step, slots


def assert_accepted_lengths(tokens: dict[str, list[int]], full: bool = False) -> None:
    """Request 0's right first draft is kept (2+ tokens), request 1's one draft and its bonus (2),
    request 2 its one token; full: every request keeps its right first draft (2+)."""
    if full:
        assert sorted(tokens) == ["r0", "r1", "r2"] and all(len(t) >= 2 for t in tokens.values()), tokens
        return
    assert len(tokens["r0"]) >= 2 and len(tokens["r1"]) == 2 and len(tokens["r2"]) == 1, tokens
