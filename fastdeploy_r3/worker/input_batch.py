"""A step's model inputs, built with numpy on the host and sent to the device in ONE copy.

Shape legend: B = requests in the step, T = tokens, MB = widest block table, S = rows that sample
(a sampling request's last num_sample_rows rows: one, or a verify step's drafts and the row before them).

    staging (pinned on CUDA, int64):
        [ input_ids T | positions T | slot_mapping T | tags T | block_tables B*MB | sample_idx S |
          seq_lens B | query_start_loc B+1 ]     └── one H2D copy of all of it ──┘
    device tensors are views of the copied buffer.

The staging buffer is reused; before refilling it the host waits for the event recorded after the
previous copy (on every step but the first that copy finished long ago: the wait is free).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from fastdeploy_r3.cache_manager.slots import slots_of
from fastdeploy_r3.worker.messages import PLACEHOLDER_TOKEN, ScheduledRequestData


class SampleRow(NamedTuple):  # a tuple: one is built per sampling row per step, on the hot path
    """A token row whose logits sample: its index in the step, its request, and the position of the
    token it draws (the row's position + 1: the draw's counter and the min_tokens count)."""

    row: int
    request: ScheduledRequestData
    position: int


@dataclass
class StepInputs:
    num_tokens: int
    input_ids: torch.Tensor  # [T] int64, device
    positions: torch.Tensor  # [T] int64, device
    slot_mapping: torch.Tensor  # [T] int64, device
    tags: torch.Tensor  # [T] int64, device
    block_tables: torch.Tensor  # [B, MB] int64, device, padded with 0
    sample_idx: torch.Tensor  # [S] int64, device: the token rows whose logits sample
    seq_lens_tensor: torch.Tensor  # [B] int32, device
    query_start_loc_tensor: torch.Tensor  # [B + 1] int32, device
    positions_np: np.ndarray  # [T] host copies, for the CPU routing writer
    slots_np: np.ndarray  # [T]
    tags_np: np.ndarray  # [T]
    query_start_loc: list[int]  # [B + 1]
    query_lens: list[int]  # [B]
    seq_lens: list[int]  # [B]
    sample_rows: list[SampleRow]  # [S], in row order
    # rows fed PLACEHOLDER_TOKEN (worker/messages.py) and the index in the step of each one's request
    placeholder_rows: np.ndarray  # [P] int64
    placeholder_requests: np.ndarray  # [P] int64


class InputBatcher:
    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self._staging = torch.empty(0, dtype=torch.int64)
        self._copied: torch.cuda.Event | None = None

    def _staging_buffer(self, n: int) -> np.ndarray:
        if self._copied is not None:
            self._copied.synchronize()  # the previous H2D read the buffer; it is free again
        if self._staging.numel() < n:
            self._staging = torch.empty(max(n, 2 * self._staging.numel()), dtype=torch.int64,
                                        pin_memory=self.device.type == "cuda")
        return self._staging.numpy()[:n]

    def prepare(self, requests: Sequence[ScheduledRequestData]) -> StepInputs:
        bs = self.block_size
        query_lens = [len(r.token_ids) for r in requests]
        seq_lens = [r.start_pos + n for r, n in zip(requests, query_lens)]
        query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).tolist()
        num_tokens = query_start_loc[-1]
        max_blocks = max(len(r.block_table) for r in requests)
        num_reqs = len(requests)
        for r in requests:
            if r.sample and not 1 <= r.num_sample_rows <= len(r.token_ids):
                raise ValueError(f"request {r.request_id} samples {r.num_sample_rows} rows of a "
                                 f"{len(r.token_ids)}-token chunk; use 1 to {len(r.token_ids)}")
        num_sample = sum(r.num_sample_rows for r in requests if r.sample)
        table_end = 4 * num_tokens + num_reqs * max_blocks
        sample_end = table_end + num_sample
        buf = self._staging_buffer(sample_end + 2 * num_reqs + 1)
        buf[sample_end : sample_end + num_reqs] = seq_lens
        buf[sample_end + num_reqs :] = query_start_loc
        ids, positions, slots, tags = (buf[i * num_tokens : (i + 1) * num_tokens] for i in range(4))
        tables = buf[4 * num_tokens : table_end].reshape(num_reqs, max_blocks)
        tables[:] = 0
        sample_rows: list[SampleRow] = []
        for b, r in enumerate(requests):
            lo, hi = query_start_loc[b], query_start_loc[b + 1]
            table = np.asarray(r.block_table, dtype=np.int64)
            pos = np.arange(r.start_pos, seq_lens[b], dtype=np.int64)  # [n]
            block_idx = pos // bs
            ids[lo:hi] = r.token_ids
            positions[lo:hi] = pos
            slots[lo:hi] = slots_of(table, pos, bs)
            tags[lo:hi] = np.asarray(r.block_tags, dtype=np.int64)[block_idx]
            tables[b, : len(table)] = table
            if r.sample:
                for row in range(hi - r.num_sample_rows, hi):
                    buf[table_end + len(sample_rows)] = row
                    sample_rows.append(SampleRow(row, r, r.start_pos + (row - lo) + 1))
        placeholder_rows = np.flatnonzero(ids == PLACEHOLDER_TOKEN)
        placeholder_requests = np.searchsorted(query_start_loc, placeholder_rows, side="right") - 1
        host = self._staging[: buf.shape[0]]
        if self.device.type == "cuda":
            dev = host.to(self.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            dev = host.clone()  # the staging buffer is refilled next step; the step's tensors must not alias it
        t = num_tokens
        return StepInputs(
            num_tokens=t,
            input_ids=dev[:t], positions=dev[t : 2 * t], slot_mapping=dev[2 * t : 3 * t], tags=dev[3 * t : 4 * t],
            block_tables=dev[4 * t : table_end].view(num_reqs, max_blocks), sample_idx=dev[table_end:sample_end],
            seq_lens_tensor=dev[sample_end : sample_end + num_reqs].to(torch.int32),
            query_start_loc_tensor=dev[sample_end + num_reqs :].to(torch.int32),
            positions_np=positions.copy(), slots_np=slots.copy(), tags_np=tags.copy(),
            query_start_loc=query_start_loc, query_lens=query_lens, seq_lens=seq_lens, sample_rows=sample_rows,
            placeholder_rows=placeholder_rows, placeholder_requests=placeholder_requests,
        )
