"""RoutingCacheManager: exact rows through a block table, and a typed error for every bad row."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer, RoutingBufferSpec
from fastdeploy_r3.cache_manager.routing_cache_manager import RoutingCacheManager
from fastdeploy_r3.cache_manager.shm import new_engine_suffix
from fastdeploy_r3.cache_manager.slots import block_slots, slots_of
from fastdeploy_r3.r3.errors import RoutingReplayError, debug_rows

BS, L, K, NUM_BLOCKS, NUM_EXPERTS = 4, 2, 3, 8, 16


@pytest.fixture
def buffer() -> Iterator[RoutingBuffer]:
    spec = RoutingBufferSpec(f"fdr3_{new_engine_suffix()}_rcm", NUM_BLOCKS * BS, L, K, "uint8")
    buf = RoutingBuffer.create(spec)
    yield buf
    buf.close()


def _fill(mgr: RoutingCacheManager, block_table: list[int], block_tags: list[int], num_rows: int,
          debug: bool = False) -> np.ndarray:
    """Write rows [0, num_rows) of one request at their slots with their blocks' tags; returns them."""
    pos = np.arange(num_rows)
    rng = np.random.default_rng(0)
    rows = debug_rows(pos, L, K, np.dtype(np.uint8)) if debug else rng.integers(0, NUM_EXPERTS, (num_rows, L, K),
                                                                                dtype=np.uint8)
    mgr.buffer.write(rows, slots_of(block_table, pos, BS), np.asarray(block_tags)[pos // BS])
    return rows


def test_gather_returns_exact_rows_through_block_table(buffer: RoutingBuffer) -> None:
    """3 blocks [5, 1, 6] of 4 tokens, 10 rows written; rows [2, 9) come back exactly, from the right slots."""
    mgr = RoutingCacheManager(buffer, BS, NUM_EXPERTS)
    rows = _fill(mgr, [5, 1, 6], [11, 12, 13], 10)
    assert slots_of([5, 1, 6], np.arange(2, 9), BS).tolist() == [22, 23, 4, 5, 6, 7, 24]
    assert block_slots([5, 1], BS).tolist() == [20, 21, 22, 23, 4, 5, 6, 7]
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


@pytest.mark.parametrize(("start", "end"), [(5, 4), (-1, 3), (0, 13)])
def test_bad_row_range_is_an_error(buffer: RoutingBuffer, start: int, end: int) -> None:
    """start > end, a negative start, or end past the 3 blocks of the table."""
    mgr = RoutingCacheManager(buffer, BS, NUM_EXPERTS)
    with pytest.raises(RoutingReplayError, match=rf"rows \[{start}, {end}\) are not within its 3 blocks"):
        mgr.gather("r", [5, 1, 6], [11, 12, 13], start, end)
