"""RoutingCacheManager: the engine's gather of a request's R3 rows out of the host buffer, refusing
anything stale. (Worker rank 0 writes the rows: worker/routing_writer.py.)

Row i of a request is the routing of the token at position i; it lives where that token's KV lives,
at slots_of(block_table, i, block_size) (cache_manager/slots.py).

Each slot carries the provenance tag of the computation that wrote it; the engine records the tag of
each block of the table (block_tags). A row is data only if its tag equals its block's tag;
anything else fails closed. Stateless: the caller owns block tables and tags, this class only checks and copies.
"""

from __future__ import annotations

import numpy as np

from fastdeploy_r3.cache_manager.routing_buffer import NO_TAG, RoutingBuffer
from fastdeploy_r3.cache_manager.slots import slots_of
from fastdeploy_r3.r3.errors import RoutingReplayError
from fastdeploy_r3.r3.layouts import first_no_route

__all__ = ["RoutingCacheManager", "RoutingReplayError"]


class RoutingCacheManager:
    def __init__(self, buffer: RoutingBuffer, block_size: int, num_experts: int, debug_mode: bool = False) -> None:
        self.buffer = buffer
        self.block_size = block_size
        self.num_experts = num_experts
        self.debug_mode = debug_mode
        self.sentinel = buffer.sentinel

    def gather(
        self, request_id: str, block_table: list[int], block_tags: list[int], start: int, end: int
    ) -> np.ndarray:
        """A fresh [end - start, L, K] copy of rows [start, end), every row checked; else RoutingReplayError."""
        bs = self.block_size
        if len(block_tags) != len(block_table):
            raise RoutingReplayError(
                f"request {request_id}: {len(block_tags)} block tags for {len(block_table)} blocks; "
                "the engine must record one tag per block of the table"
            )
        if not 0 <= start <= end or end > len(block_table) * bs:
            raise RoutingReplayError(
                f"request {request_id}: rows [{start}, {end}) are not within its {len(block_table)} blocks "
                f"of {bs} tokens ({len(block_table) * bs} rows)"
            )
        positions = np.arange(start, end, dtype=np.int64)  # [R]
        slots = slots_of(block_table, positions, bs)  # [R]
        table_index = positions // bs  # [R]
        want_tags = np.asarray(block_tags, dtype=np.int64)[table_index]  # [R]
        self._check_tags(request_id, block_table, start, slots, table_index, want_tags, self.buffer.tags[slots])
        rows = self.buffer.rows[slots]  # [R, L, K]; fancy indexing copies
        # A writer racing this copy would change the tags of the slots it overwrote: re-check after.
        self._check_tags(request_id, block_table, start, slots, table_index, want_tags, self.buffer.tags[slots])
        self._check_rows(request_id, block_table, start, table_index, rows)
        return np.ascontiguousarray(rows)

    # -- checks ------------------------------------------------------------------------------------------

    def _check_tags(
        self,
        request_id: str,
        block_table: list[int],
        start: int,
        slots: np.ndarray,
        table_index: np.ndarray,
        want_tags: np.ndarray,
        tags: np.ndarray,
    ) -> None:
        bad = np.nonzero((tags != want_tags) | (tags == NO_TAG))[0]
        if not len(bad):
            return
        r = int(bad[0])
        row, block, slot = start + r, block_table[int(table_index[r])], int(slots[r])
        found, want = int(tags[r]), int(want_tags[r])
        where = f"row {row} of request {request_id} (block {block}, slot {slot})"
        if want == NO_TAG:
            msg = f"{where}: the engine recorded no tag for block {block}; it was never computed"
        elif found == NO_TAG:
            msg = f"{where} was never written (tag 0) but block {block} was computed by attempt {want}"
        else:
            msg = f"{where} carries tag {found} but block {block} was computed by attempt {want} (stale slot)"
        raise RoutingReplayError(msg + f"; {len(bad)} bad row(s) in all")

    def _check_rows(
        self, request_id: str, block_table: list[int], start: int, table_index: np.ndarray, rows: np.ndarray
    ) -> None:
        def fail(r: int, layer: int, what: str) -> RoutingReplayError:
            block = block_table[int(table_index[r])]
            return RoutingReplayError(f"row {start + r} of request {request_id} (block {block}, MoE layer {layer}) "
                                      f"{what}: ids {rows[r, layer].tolist()}")

        if not self.debug_mode and self.num_experts <= self.sentinel and not (rows >= self.num_experts).any():
            return  # one pass in the rows' own dtype: no sentinel (>= num_experts) and no id out of range
        hole = first_no_route(rows)
        if hole is not None:
            raise fail(*hole, f"holds the sentinel {self.sentinel} ('no route') though its tag is valid")
        ids = rows.astype(np.int64, copy=False)  # [R, L, K]
        if self.debug_mode:  # debug rows hold positions, which may exceed num_experts
            want = np.arange(start, start + len(rows), dtype=np.int64) % self.sentinel  # [R]
            bad, what = ids != want[:, None, None], "does not equal its position mod sentinel (debug mode)"
        else:
            bad, what = ids >= self.num_experts, f"holds an expert id >= num_experts ({self.num_experts})"
        found = np.argwhere(bad)  # [n, 3] (row, layer, k)
        if len(found):
            raise fail(int(found[0][0]), int(found[0][1]), what)
