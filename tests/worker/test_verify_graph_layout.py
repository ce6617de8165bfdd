"""Verify steps in CUDA graphs (worker/cuda_graph_runner.py): the padded layout of query length Q, where
row b owns token slots [b*Q, (b+1)*Q) and puts its real tokens last, gives the packed eager step's tokens,
logits and R3 rows. CI has no GPU, so the "graph" here replays the same forward eagerly on the CPU (the
layout, the sampling rows and the R3 gather are what is under test); tests/gpu/test_spec_cuda.py runs real
graphs on an H200. MTP drafts read the padded graph's hidden states back in packed order."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from fake_model import make_fake_model
from step_bench import StepBench
from verify_graph_cases import assert_accepted_lengths, verify_step_after_prefill

from fastdeploy_r3.worker.cuda_graph_runner import DecodeGraphs, verify_layout
from fastdeploy_r3.worker.messages import ScheduledRequestData, StepInput


def test_each_rows_tokens_take_the_last_slots_of_its_window() -> None:
    # rows of 1, 3 and 2 tokens in windows of 4: slots 3 | 5 6 7 | 10 11
    assert verify_layout([1, 3, 2], 4).tolist() == [3, 5, 6, 7, 10, 11]
    assert verify_layout([4, 4], 4).tolist() == list(range(8))  # full rows: the packed layout itself
    assert verify_layout([1, 1, 1], 1).tolist() == [0, 1, 2]  # a decode step


def _row(rid: str, tokens: list[int], pos: int = 10, sample_rows: int | None = None) -> ScheduledRequestData:
    return ScheduledRequestData(rid, tokens, pos, [0, 1, 2, 3], [1] * 4, sample=True,
                                num_sample_rows=len(tokens) if sample_rows is None else sample_rows)  # fmt: skip


def test_which_steps_replay_which_graph() -> None:
    g = DecodeGraphs(torch.nn.Identity(), [], None, max_num_seqs=8, max_model_len=64, block_size=4,
                     device=torch.device("cpu"), verify_query_len=4)  # fmt: skip
    assert g.query_len_for([_row("a", [5]), _row("b", [6])], 4) == 1  # plain decode
    assert g.query_len_for([_row("a", [5, 7, 8]), _row("b", [6])], 4) == 4  # verify, padded to k + 1
    assert g.query_len_for([_row("a", [5, 7, 8, 9, 1])], 4) is None  # more than k drafts
    assert g.query_len_for([_row("a", [5, 7, 8], sample_rows=1)], 4) is None  # a prefill chunk, not a verify
    assert g.query_len_for([_row("a", [5])] * 9, 4) is None  # more requests than any graph
    assert g.query_len_for([_row("a", [5])], 17) is None  # a block table wider than the graphs'
    plain = DecodeGraphs(torch.nn.Identity(), [], None, max_num_seqs=8, max_model_len=64, block_size=4,
                         device=torch.device("cpu"))  # fmt: skip
    assert plain.query_len_for([_row("a", [5]), _row("b", [6])], 4) == 1
    assert plain.query_len_for([_row("a", [5, 7], sample_rows=1)], 4) is None  # no verify graphs: eager
    assert plain.query_len_for([_row("a", [5, 7])], 4) is None


class _EagerReplay:
    """Stands in for a captured graph on the CPU: the same forward, run when replayed."""

    def __init__(self, graphs: DecodeGraphs, size: int, q: int) -> None:
        self.graphs, self.size, self.q = graphs, size, q

    def replay(self) -> None:
        g, cap = self.graphs, self.graphs.routing_capture
        # a replayed graph runs kernels only: the capture's step (begun by the runner) stays as it was
        step = (cap._num_tokens, cap._positions, cap._captured)
        g.hidden[(self.size, self.q)], g.logits[(self.size, self.q)] = g._forward(self.size, self.q)
        cap._num_tokens, cap._positions, cap._captured = step


class _CpuGraphs(DecodeGraphs):
    """The reference attention reads the host lists a real graph never reads: fill them from the tensors."""

    def _metadata(self, size: int, q: int):  # noqa: ANN202
        meta = super()._metadata(size, q)
        meta.seq_lens = self.seq_lens[:size].tolist()
        return meta


@pytest.mark.parametrize("full", [False, True])
def test_a_verify_step_through_the_padded_layout_equals_the_packed_eager_step(fake_model_dir, full: bool) -> None:  # noqa: ANN001
    """Rows of 4, 2 and 1 tokens go through the layout; full rows (4, 4, 4: packed order is slot order) are
    copied as they are, the padding row 4 keeping whatever ids and positions it held, with no KV slot."""
    sb = StepBench(fake_model_dir("qwen3_moe"), "cpu", "float32", "auto", 4, 64, 64, 4, 256, True)
    try:
        step, slots = verify_step_after_prefill(sb, full)
        want_tokens = sb._step(step)
        want_rows = sb.routing_host.rows[slots].copy()
        sb.routing_host.rows[slots] = 0

        runner = sb.runner
        graphs = _CpuGraphs(runner.model, runner._kv_caches(), runner.routing_capture, 4, 64, 4,
                            torch.device("cpu"), verify_query_len=4)  # fmt: skip
        graphs.graphs = {(size, q): _EagerReplay(graphs, size, q) for q, sizes in graphs.query_sizes.items()
                         for size in sizes}  # fmt: skip
        runner.decode_graphs = graphs
        got_tokens = sb._step(step)  # the same positions again: the KV it writes is the same
        assert graphs.replays == {1: 0, 4: 1}  # padded to 4 requests x 4 slots
        assert got_tokens == want_tokens
        assert_accepted_lengths(got_tokens, full)
        assert np.array_equal(sb.routing_host.rows[slots], want_rows)
        assert want_rows.shape[0] == (12 if full else 4 + 2 + 1) and (want_rows != 255).all()  # no sentinel
    finally:
        sb.close()


def test_mtp_drafts_after_the_padded_layout_equal_the_eager_step_s(tmp_path) -> None:  # noqa: ANN001
    """The fake GLM with a draft layer: from the same draft state, the drafter reads the padded graph's
    hidden states in packed order (DecodeGraphs.hidden_of) and drafts what it drafts after the eager step."""
    model = make_fake_model("glm4_moe", str(tmp_path / "glm"), draft_layer=True)
    sb = StepBench(model, "cpu", "float32", "auto", 4, 64, 64, 4, 256, True,
                   speculative_config={"method": "mtp", "num_speculative_tokens": 3})  # fmt: skip
    try:
        step, _ = verify_step_after_prefill(sb)
        runner, drafter = sb.runner, sb.runner.drafter
        states, free = copy.deepcopy(drafter._states), list(drafter._free)
        want = runner.execute(StepInput(1000, step))
        drafter._states, drafter._free = states, free  # the draft state the eager step started from
        graphs = _CpuGraphs(runner.model, runner._kv_caches(), runner.routing_capture, 4, 64, 4,
                            torch.device("cpu"), verify_query_len=4)  # fmt: skip
        graphs.graphs = {(size, q): _EagerReplay(graphs, size, q) for q, sizes in graphs.query_sizes.items()
                         for size in sizes}  # fmt: skip
        runner.decode_graphs = graphs
        got = runner.execute(StepInput(1001, step))
        assert graphs.replays == {1: 0, 4: 1}
        assert got.sampled_token_ids == want.sampled_token_ids
        assert got.draft_token_ids == want.draft_token_ids
        assert sorted(got.draft_token_ids) == ["r0", "r1", "r2"]
        assert all(len(d) == 3 for d in got.draft_token_ids.values())
    finally:
        sb.close()
