"""The worker's persistent per-request block tables, updated in place by each step's diffs.

The engine sends a request's whole block table the first time, after a preemption, on a retry and
after any failed step; otherwise only the blocks appended since (engine/step_builder.py):

    ScheduledRequestData.block_table = ids of blocks [blocks_from, blocks_from + n)  (n = 0 most steps)

    tables [R, MB] int64   row r: the block ids of the request held in row r (stale past num_blocks[r])
    tags   [R, MB] int64   their routing tags
    num_blocks [R]         row_of: request id -> row; R and MB double when full
    sample_step [R], sample_index [R]   the last step that sampled the request and the index of its last
                                        sampled id in that step's ids (a step scheduled ahead feeds it)

Applying a diff sets [blocks_from, blocks_from + n) and makes the row hold blocks_from + n blocks, so
the same message applied twice (a multi-token runner re-feeding its chunk) changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fastdeploy_r3.worker.messages import ScheduledRequestData


class BlockTableGapError(RuntimeError):
    """A diff starts past the blocks the worker holds for its request: a message was lost."""


class BatchState:
    def __init__(self, rows: int = 16, max_blocks: int = 16) -> None:
        self.tables = np.zeros((rows, max_blocks), dtype=np.int64)
        self.tags = np.zeros((rows, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.sample_step = np.full(rows, -1, dtype=np.int64)
        self.sample_index = np.zeros(rows, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))

    def forget(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.num_blocks[row] = 0
            self.sample_step[row] = -1
            self._free_rows.append(row)

    def apply(self, requests: Sequence[ScheduledRequestData]) -> np.ndarray:
        """Apply the step's block diffs; returns the row of each request [B] int64."""
        row_of = self.row_of
        rows = np.empty(len(requests), dtype=np.int64)
        for b, r in enumerate(requests):
            row = row_of.get(r.request_id)
            if row is None:
                row = self._new_row(r.request_id)
            rows[b] = row
            if r.block_table or r.blocks_from == 0:  # most decode steps append nothing
                self._set(row, r)
        return rows

    def _set(self, row: int, r: ScheduledRequestData) -> None:
        start, n = r.blocks_from, len(r.block_table)
        if start > self.num_blocks[row]:
            raise BlockTableGapError(
                f"request {r.request_id}: the step sends its blocks from {start} on but this worker holds "
                f"{int(self.num_blocks[row])}; the engine must resend its whole block table")
        if len(r.block_tags) != n:
            raise ValueError(f"request {r.request_id}: {n} block ids but {len(r.block_tags)} tags")
        end = start + n
        if end > self.tables.shape[1]:
            width = max(end, 2 * self.tables.shape[1])
            self.tables = _widen(self.tables, width)
            self.tags = _widen(self.tags, width)
        self.tables[row, start:end] = r.block_table
        self.tags[row, start:end] = r.block_tags
        self.num_blocks[row] = end

    def _new_row(self, request_id: str) -> int:
        if not self._free_rows:
            n = self.tables.shape[0]
            self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
            self.tags = np.concatenate([self.tags, np.zeros_like(self.tags)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self.sample_step = np.concatenate([self.sample_step, np.full_like(self.sample_step, -1)])
            self.sample_index = np.concatenate([self.sample_index, np.zeros_like(self.sample_index)])
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        row = self._free_rows.pop()
        self.row_of[request_id] = row
        self.num_blocks[row] = 0
        self.sample_step[row] = -1
        return row

    def record_samples(self, step_id: int, rows: np.ndarray) -> None:
        """Step step_id sampled ids [S] for the state rows [S] (a request's rows consecutive, in order):
        each request's last one is what a step scheduled ahead feeds."""
        if not len(rows):
            return
        last = np.ones(len(rows), dtype=bool)
        last[:-1] = rows[1:] != rows[:-1]
        self.sample_step[rows[last]] = step_id
        self.sample_index[rows[last]] = np.flatnonzero(last)

    def previous_samples(self, step_id: int, rows: np.ndarray) -> np.ndarray:
        """Indices into step (step_id - 1)'s sampled ids of the requests in state rows [P]; -1 where that
        step sampled nothing for one (it failed, or never had it)."""
        return np.where(self.sample_step[rows] == step_id - 1, self.sample_index[rows], -1)


def _widen(a: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((a.shape[0], width), dtype=a.dtype)
    out[:, : a.shape[1]] = a
    return out
