"""RoutingCacheManager: reads a request's R3 rows out of the host buffer, and refuses anything stale.

Row i of a request is the routing of the token at position i; it lives where that token's KV lives:

    block_table = [7, 2, 5]          block_size = 4
    row:   0 1 2 3 | 4 5 6 7 | 8 9 ...
    slot: 28 ..31  | 8 .. 11 | 20 21 ...      slot = block_table[i // bs] * bs + i % bs

Each slot carries the provenance tag of the computation that wrote it; the engine records the tag of
each block of the table (block_tags). A row is data only if its tag equals its block's tag (DESIGN.md
§5.4-5.5). Stateless: the caller owns block tables and tags, this class only checks and copies.
"""

from __future__ import annotations

import numpy as np

from fastdeploy_r3.cache_manager.routing_buffer import NO_TAG, RoutingBuffer


class RoutingReplayError(RuntimeError):
    """R3 rows are missing, stale or corrupt; the request must fail rather than return them."""


class RoutingCacheManager:
    def __init__(self, buffer: RoutingBuffer, block_size: int, num_experts: int, debug_mode: bool = False) -> None:
        self.buffer = buffer
        self.block_size = block_size
        self.num_experts = num_experts
        self.debug_mode = debug_mode
        self.sentinel = buffer.sentinel

    def slots_of(self, block_table: list[int], start: int, end: int) -> np.ndarray:
        """Slots [end - start] holding rows [start, end) of a request with this block table."""
        i = np.arange(start, end, dtype=np.int64)  # [R]
        return np.asarray(block_table, dtype=np.int64)[i // self.block_size] * self.block_size + i % self.block_size

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
        slots = self.slots_of(block_table, start, end)  # [R]
        table_index = np.arange(start, end, dtype=np.int64) // bs  # [R]
        want_tags = np.asarray(block_tags, dtype=np.int64)[table_index]  # [R]
        self._check_tags(request_id, block_table, start, slots, table_index, want_tags, self.buffer.tags[slots])
        rows = self.buffer.rows[slots]  # [R, L, K]; fancy indexing copies
        # A writer racing this copy would change the tags of the slots it overwrote: re-check after.
        self._check_tags(request_id, block_table, start, slots, table_index, want_tags, self.buffer.tags[slots])
        self._check_rows(request_id, block_table, start, table_index, rows)
        return np.ascontiguousarray(rows)

    def write_step(
        self, slots: np.ndarray, rows: np.ndarray, tags: np.ndarray, positions: np.ndarray | None = None
    ) -> None:
        """Worker rank 0's CPU path: rows [T, L, K] and tags [T] into the host buffer at slots [T].

        Only real tokens: padded tokens must be dropped by the caller. In debug mode positions [T] is
        required and every row must equal its position mod sentinel, so an addressing bug in the
        worker shows up here rather than at gather.
        """
        slots, tags = np.asarray(slots, dtype=np.int64), np.asarray(tags, dtype=np.int64)
        T = len(slots)
        L, K = self.buffer.rows.shape[1:]
        if rows.shape != (T, L, K) or tags.shape != (T,):
            raise RoutingReplayError(f"write_step: rows {rows.shape} / tags {tags.shape} do not match "
                                     f"[{T}, {L}, {K}] / [{T}] for {T} slots")
        if rows.dtype != self.buffer.rows.dtype:
            raise RoutingReplayError(
                f"write_step: rows are {rows.dtype}, the host buffer holds {self.buffer.rows.dtype}"
            )
        bad = np.nonzero((slots < 0) | (slots >= len(self.buffer.tags)))[0]
        if len(bad):
            t = int(bad[0])
            raise RoutingReplayError(f"write_step: token {t} of the step has slot {int(slots[t])}, outside "
                                     f"[0, {len(self.buffer.tags)}); drop padded tokens before writing")
        if (tags == NO_TAG).any():
            raise RoutingReplayError(f"write_step: tag {NO_TAG} means 'never written'; give every computed block a tag")
        if self.debug_mode:
            if positions is None:
                raise RoutingReplayError("write_step: debug mode needs the positions of the step's tokens")
            want = np.asarray(positions, dtype=np.int64) % self.sentinel  # [T]
            bad = np.nonzero((rows.astype(np.int64) != want[:, None, None]).any(axis=(1, 2)))[0]
            if len(bad):
                t = int(bad[0])
                raise RoutingReplayError(
                    f"debug mode: token {t} of the step (position {int(positions[t])}, slot {int(slots[t])}) "
                    f"carries ids {rows[t].reshape(-1)[:4].tolist()}... instead of {int(want[t])}"
                )
        self.buffer.write(slots, rows, tags)

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
        ids = rows.astype(np.int64, copy=False)  # [R, L, K]
        checks = [
            (ids == self.sentinel, f"holds the sentinel {self.sentinel} ('no route') though its tag is valid"),
        ]
        if not self.debug_mode:  # debug rows hold positions, which may exceed num_experts
            checks.append((ids >= self.num_experts, f"holds an expert id >= num_experts ({self.num_experts})"))
        else:
            want = np.arange(start, start + len(rows), dtype=np.int64) % self.sentinel  # [R]
            checks.append((ids != want[:, None, None], "does not equal its position mod sentinel (debug mode)"))
        for bad_mask, what in checks:
            bad = np.argwhere(bad_mask)  # [n, 3] (row, layer, k)
            if len(bad):
                r, layer, _ = (int(x) for x in bad[0])
                block = block_table[int(table_index[r])]
                raise RoutingReplayError(
                    f"row {start + r} of request {request_id} (block {block}, MoE layer {layer}) {what}: "
                    f"ids {rows[r, layer].tolist()}"
                )
