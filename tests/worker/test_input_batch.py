"""A step's inputs packed on the host and sent as one buffer: exact values for two requests."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fastdeploy_r3.worker.input_batch import InputBatcher
from fastdeploy_r3.worker.messages import ScheduledRequestData


def test_two_requests_prefill_chunk_and_decode() -> None:
    """block_size 4. 'a' prefills positions 0..4 over blocks [7, 2] (no sample: a chunk);
    'b' decodes position 9 in its third block, 5, and samples."""
    a = ScheduledRequestData("a", [11, 12, 13, 14, 15], 0, [7, 2], [70, 20], sample=False)
    b = ScheduledRequestData("b", [99], 9, [1, 3, 5], [10, 30, 50], sample=True)
    batcher = InputBatcher(block_size=4, device=torch.device("cpu"))
    inp = batcher.prepare([a, b])
    assert inp.num_tokens == 6
    assert inp.input_ids.tolist() == [11, 12, 13, 14, 15, 99]
    assert inp.positions.tolist() == [0, 1, 2, 3, 4, 9]
    assert inp.slot_mapping.tolist() == [28, 29, 30, 31, 8, 21]
    assert inp.tags.tolist() == [70, 70, 70, 70, 20, 50]
    assert inp.block_tables.tolist() == [[7, 2, 0], [1, 3, 5]]
    assert inp.sample_idx.tolist() == [5]
    assert inp.seq_lens_tensor.tolist() == [5, 10] and inp.query_start_loc_tensor.tolist() == [0, 5, 6]
    assert inp.seq_lens_tensor.dtype == torch.int32
    assert [(s.row, s.request.request_id, s.position) for s in inp.sample_rows] == [(5, "b", 10)]
    assert (inp.query_start_loc, inp.query_lens, inp.seq_lens) == ([0, 5, 6], [5, 1], [5, 10])
    # the next step refills the staging buffer; this step's tensors do not change under it
    batcher.prepare([ScheduledRequestData("c", [1], 0, [4], [40], sample=True)])
    assert inp.input_ids.tolist() == [11, 12, 13, 14, 15, 99]


def test_a_verify_chunk_samples_its_last_rows_each_drawing_the_next_position() -> None:
    """'v' feeds [5, 6, 7] at positions 8..10 with num_sample_rows=3 (two drafts and the token before
    them): rows 1..3 sample, drawing positions 9, 10, 11; 'a' before it samples its last row only."""
    a = ScheduledRequestData("a", [1], 3, [0], [1], sample=True)
    v = ScheduledRequestData("v", [5, 6, 7], 8, [4, 6, 9], [40, 60, 90], sample=True, num_sample_rows=3)
    inp = InputBatcher(block_size=4, device=torch.device("cpu")).prepare([a, v])
    assert inp.sample_idx.tolist() == [0, 1, 2, 3]
    assert [(s.request.request_id, s.position) for s in inp.sample_rows] == [("a", 4), ("v", 9), ("v", 10), ("v", 11)]
    with pytest.raises(ValueError, match="samples 4 rows of a 3-token chunk"):
        InputBatcher(block_size=4, device=torch.device("cpu")).prepare([replace(v, num_sample_rows=4)])


def test_sequence_lengths_travel_as_int32_in_the_same_copy_each_on_a_16_byte_boundary() -> None:
    """Three requests (an odd count: the int32 rows do not fill whole int64 slots): 'p' prefills 5
    tokens without sampling, 'd' decodes, 'v' verifies 2 of its 3 rows. seq_lens and query_start_loc are
    int32 views of the step's one buffer, each starting on a 16-byte boundary (the alignment class a
    Triton kernel was compiled for), and keep their values when the next step refills the staging buffer."""
    p = ScheduledRequestData("p", [1, 2, 3, 4, 5], 0, [3, 8], [30, 80], sample=False)
    d = ScheduledRequestData("d", [6], 6, [2, 9], [20, 90], sample=True)
    v = ScheduledRequestData("v", [7, 8, 9], 4, [5, 1], [50, 10], sample=True, num_sample_rows=2)
    batcher = InputBatcher(block_size=4, device=torch.device("cpu"))
    inp = batcher.prepare([p, d, v])
    assert inp.sample_idx.tolist() == [5, 7, 8]
    assert [(s.request.request_id, s.position) for s in inp.sample_rows] == [("d", 7), ("v", 6), ("v", 7)]
    for t, want in ((inp.seq_lens_tensor, [5, 7, 7]), (inp.query_start_loc_tensor, [0, 5, 6, 9])):
        assert t.dtype == torch.int32 and t.tolist() == want and t.data_ptr() % 16 == 0
    batcher.prepare([ScheduledRequestData("c", [1, 2], 0, [4], [40], sample=True, num_sample_rows=2)])
    assert inp.seq_lens_tensor.tolist() == [5, 7, 7] and inp.query_start_loc_tensor.tolist() == [0, 5, 6, 9]
