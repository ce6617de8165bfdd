"""RoutingCacheManager: exact rows through a block table, and a typed error for every bad row."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer, RoutingBufferSpec, debug_rows
from fastdeploy_r3.cache_manager.routing_cache_manager import RoutingCacheManager, RoutingReplayError
from fastdeploy_r3.cache_manager.shm import new_engine_suffix

BS, L, K, NUM_BLOCKS, NUM_EXPERTS = 4, 2, 3, 8, 16


@pytest.fixture
def buffer() -> Iterator[RoutingBuffer]:
    spec = RoutingBufferSpec(f"fdr3_{new_engine_suffix()}_rcm", NUM_BLOCKS * BS, L, K, "uint8")
    buf = RoutingBuffer.create(spec)
    yield buf
    buf.close()


def _fill(mgr: RoutingCacheManager, block_table: list[int], block_tags: list[int], num_rows: int,
          debug: bool = False) -> np.ndarray:
    """Write rows [0, num_rows) of one request the way worker rank 0 does; returns them."""
    pos = np.arange(num_rows)
    rng = np.random.default_rng(0)
    rows = debug_rows(pos, L, K, np.dtype(np.uint8)) if debug else rng.integers(0, NUM_EXPERTS, (num_rows, L, K),
                                                                                dtype=np.uint8)
    mgr.write_step(mgr.slots_of(block_table, 0, num_rows), rows, np.asarray(block_tags)[pos // BS], positions=pos)
    return rows


def test_gather_returns_exact_rows_through_block_table(buffer: RoutingBuffer) -> None:
    """3 blocks [5, 1, 6] of 4 tokens, 10 rows written; rows [2, 9) come back exactly, from the right slots."""
    mgr = RoutingCacheManager(buffer, BS, NUM_EXPERTS)
    rows = _fill(mgr, [5, 1, 6], [11, 12, 13], 10)
    assert mgr.slots_of([5, 1, 6], 2, 9).tolist() == [22, 23, 4, 5, 6, 7, 24]
    out = mgr.gather("cmpl-1", [5, 1, 6], [11, 12, 13], 2, 9)
    assert out.shape == (7, L, K) and out.dtype == np.uint8 and out.flags.c_contiguous
    assert np.array_equal(out, rows[2:9])
    out[:] = 0  # a fresh copy: the host buffer is not touched
    assert np.array_equal(buffer.rows[22], rows[2])
    assert mgr.gather("cmpl-1", [5, 1, 6], [11, 12, 13], 4, 4).shape == (0, L, K)


def test_stale_tag_names_row_block_and_both_tags(buffer: RoutingBuffer) -> None:
    """Block 1 was recomputed under tag 12 but slot 5 (row 5) still holds a row from attempt 9."""
    mgr = RoutingCacheManager(buffer, BS, NUM_EXPERTS)
    _fill(mgr, [5, 1, 6], [11, 12, 13], 10)
    buffer.tags[5] = 9
    with pytest.raises(RoutingReplayError, match=r"row 5 of request cmpl-3 \(block 1, slot 5\) carries tag 9 "
                                                 r"but block 1 was computed by attempt 12 \(stale slot\)"):
        mgr.gather("cmpl-3", [5, 1, 6], [11, 12, 13], 0, 10)


def test_never_written_row_is_an_error(buffer: RoutingBuffer) -> None:
    """Rows [0, 10) written, but the caller asks for row 10 (slot 26), which nobody wrote."""
    mgr = RoutingCacheManager(buffer, BS, NUM_EXPERTS)
    _fill(mgr, [5, 1, 6], [11, 12, 13], 10)
    with pytest.raises(RoutingReplayError, match=r"row 10 of request r \(block 6, slot 26\) was never written"):
        mgr.gather("r", [5, 1, 6], [11, 12, 13], 0, 11)


def test_block_without_recorded_tag_is_an_error(buffer: RoutingBuffer) -> None:
    """The engine's own tag for a block is 0: nothing can match it."""
    mgr = RoutingCacheManager(buffer, BS, NUM_EXPERTS)
    with pytest.raises(RoutingReplayError, match="recorded no tag for block 3"):
        mgr.gather("r", [3], [0], 0, 2)


def test_sentinel_row_with_valid_tag_is_an_error(buffer: RoutingBuffer) -> None:
    """A tagged row that still holds the 'no route' sentinel (255) in MoE layer 1."""
    mgr = RoutingCacheManager(buffer, BS, NUM_EXPERTS)
    _fill(mgr, [5, 1, 6, 2], [11, 12, 13, 14], 16)
    buffer.rows[9, 1, 2] = 255  # row 13 lives in block 2 at offset 1
    with pytest.raises(RoutingReplayError, match=r"row 13 of request r \(block 2, MoE layer 1\) holds the sentinel"):
        mgr.gather("r", [5, 1, 6, 2], [11, 12, 13, 14], 0, 16)


def test_expert_id_out_of_range_is_an_error(buffer: RoutingBuffer) -> None:
    """An id >= num_experts in a tagged row."""
    mgr = RoutingCacheManager(buffer, BS, NUM_EXPERTS)
    _fill(mgr, [5, 1], [11, 12], 8)
    buffer.rows[4, 0, 0] = NUM_EXPERTS
    with pytest.raises(RoutingReplayError, match=r"row 4 of request r .* >= num_experts \(16\)"):
        mgr.gather("r", [5, 1], [11, 12], 0, 8)


def test_debug_mode_checks_positions_at_gather(buffer: RoutingBuffer) -> None:
    """Debug rows round-trip; a row swapped with its neighbour's is caught."""
    mgr = RoutingCacheManager(buffer, BS, NUM_EXPERTS, debug_mode=True)
    rows = _fill(mgr, [5, 1, 6], [11, 12, 13], 12, debug=True)
    assert np.array_equal(mgr.gather("r", [5, 1, 6], [11, 12, 13], 3, 12), rows[3:12])
    buffer.rows[[5, 6]] = buffer.rows[[6, 5]]  # rows 5 and 6 exchanged
    with pytest.raises(RoutingReplayError, match=r"row 5 of request r \(block 1, MoE layer 0\) does not equal "
                                                 r"its position"):
        mgr.gather("r", [5, 1, 6], [11, 12, 13], 0, 12)


def test_debug_mode_checks_positions_at_write(buffer: RoutingBuffer) -> None:
    """Worker rank 0 writes rows for positions 0..3 but labels them 1..4: refused before the buffer changes."""
    mgr = RoutingCacheManager(buffer, BS, NUM_EXPERTS, debug_mode=True)
    rows = debug_rows(np.arange(4), L, K, np.dtype(np.uint8))
    with pytest.raises(RoutingReplayError, match=r"token 0 of the step \(position 1, slot 20\)"):
        mgr.write_step(np.arange(20, 24), rows, np.full(4, 7), positions=np.arange(1, 5))
    with pytest.raises(RoutingReplayError, match="needs the positions"):
        mgr.write_step(np.arange(20, 24), rows, np.full(4, 7))
    assert (buffer.tags[20:24] == 0).all()


@pytest.mark.parametrize(("start", "end"), [(5, 4), (-1, 3), (0, 13)])
def test_bad_row_range_is_an_error(buffer: RoutingBuffer, start: int, end: int) -> None:
    """start > end, a negative start, or end past the 3 blocks of the table."""
    mgr = RoutingCacheManager(buffer, BS, NUM_EXPERTS)
    with pytest.raises(RoutingReplayError, match=rf"rows \[{start}, {end}\) are not within its 3 blocks"):
        mgr.gather("r", [5, 1, 6], [11, 12, 13], start, end)


def test_write_step_rejects_bad_inputs(buffer: RoutingBuffer) -> None:
    """Wrong dtype, a padded slot (-1), or tag 0 never reach the buffer."""
    mgr = RoutingCacheManager(buffer, BS, NUM_EXPERTS)
    rows = np.zeros((2, L, K), np.uint8)
    with pytest.raises(RoutingReplayError, match="rows are int32"):
        mgr.write_step(np.array([0, 1]), rows.astype(np.int32), np.array([1, 1]))
    with pytest.raises(RoutingReplayError, match="drop padded tokens"):
        mgr.write_step(np.array([0, -1]), rows, np.array([1, 1]))
    with pytest.raises(RoutingReplayError, match="tag 0"):
        mgr.write_step(np.array([0, 1]), rows, np.array([1, 0]))
    assert (buffer.tags == 0).all()
