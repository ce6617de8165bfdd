"""CpuRoutingWriter: worker rank 0's checked write of a step's rows into the host buffer."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer, RoutingBufferSpec
from fastdeploy_r3.cache_manager.shm import new_engine_suffix
from fastdeploy_r3.r3.errors import RoutingReplayError, debug_rows
from fastdeploy_r3.worker.routing_capture import RoutingCapture
from fastdeploy_r3.worker.routing_writer import CpuRoutingWriter, make_routing_writer

BS, L, K, NUM_BLOCKS, NUM_EXPERTS = 4, 2, 3, 8, 16


@pytest.fixture
def buffer() -> Iterator[RoutingBuffer]:
    spec = RoutingBufferSpec(f"fdr3_{new_engine_suffix()}_rw", NUM_BLOCKS * BS, L, K, "uint8")
    buf = RoutingBuffer.create(spec)
    yield buf
    buf.close()


def test_step_rows_land_at_their_slots_with_their_tags(buffer: RoutingBuffer) -> None:
    """3 tokens of a step captured on CPU: rows_of() then write() puts them at slots 9, 2, 30, tag 5."""
    writer = make_routing_writer(buffer, torch.device("cpu"), debug_mode=False)
    assert isinstance(writer, CpuRoutingWriter)
    cap = RoutingCapture(8, L, K, NUM_EXPERTS, np.dtype(np.uint8))
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=torch.int32)  # [T=3, K]
    cap.begin_step(3)
    for layer in range(L):
        cap.capture(layer, ids + layer)
    slots = torch.tensor([9, 2, 30])
    writer.write(writer.rows_of(cap, 3), slots, torch.full((3,), 5))
    assert buffer.rows[2].tolist() == [[4, 5, 6], [5, 6, 7]]
    assert buffer.tags[[9, 2, 30]].tolist() == [5, 5, 5] and buffer.tags[0] == 0


def test_debug_mode_checks_positions_at_write(buffer: RoutingBuffer) -> None:
    """Worker rank 0 writes rows for positions 0..3 but labels them 1..4: refused before the buffer changes."""
    writer = CpuRoutingWriter(buffer, debug_mode=True)
    rows = debug_rows(np.arange(4), L, K, np.dtype(np.uint8))
    with pytest.raises(RoutingReplayError, match=r"token 0 of the step \(position 1, slot 20\)"):
        writer.write(rows, np.arange(20, 24), np.full(4, 7), positions=np.arange(1, 5))
    with pytest.raises(RoutingReplayError, match="needs the positions"):
        writer.write(rows, np.arange(20, 24), np.full(4, 7))
    assert (buffer.tags[20:24] == 0).all()


def test_write_rejects_bad_inputs(buffer: RoutingBuffer) -> None:
    """Wrong dtype, a padded slot (-1), or tag 0 never reach the buffer."""
    writer = CpuRoutingWriter(buffer)
    rows = np.zeros((2, L, K), np.uint8)
    with pytest.raises(RoutingReplayError, match="rows are int32"):
        writer.write(rows.astype(np.int32), np.array([0, 1]), np.array([1, 1]))
    with pytest.raises(RoutingReplayError, match="drop padded tokens"):
        writer.write(rows, np.array([0, -1]), np.array([1, 1]))
    with pytest.raises(RoutingReplayError, match="tag 0"):
        writer.write(rows, np.array([0, 1]), np.array([1, 0]))
    assert (buffer.tags == 0).all()
