"""A step's model inputs, built with numpy on the host and sent to the device in ONE copy.

Shape legend: B = requests in the step, T = tokens, MB = widest block table, S = rows that sample
(a sampling request's last num_sample_rows rows: one, or a verify step's drafts and the row before them).

    staging (pinned on CUDA, int64):
        [ input_ids T | positions T | slot_mapping T | tags T | block_tables B*MB | sample_idx S |
          seq_lens B (int32) | query_start_loc B+1 (int32) ]     └── one H2D copy of all of it ──┘
    device tensors are views of the copied buffer (the two int32 runs each from a 16-byte boundary).

The staging buffer is reused; before refilling it the host waits for the event recorded after the
previous copy (on every step but the first that copy finished long ago: the wait is free).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import numpy as np
import torch

from fastdeploy_r3.worker.batch_state import BatchState
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
    state_rows: np.ndarray  # [B] each request's row in the batch state (worker/batch_state.py)
    sample_requests: np.ndarray  # [S] the index in the step of each sampling row's request


class InputBatcher:
    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self._staging = torch.empty(0, dtype=torch.int64)
        self._copied: torch.cuda.Event | None = None
        self.state = BatchState()  # every request's block table, kept between steps

    def _staging_buffer(self, n: int) -> np.ndarray:
        if self._copied is not None:
            self._copied.synchronize()  # the previous H2D read the buffer; it is free again
        if self._staging.numel() < n:
            self._staging = torch.empty(max(n, 2 * self._staging.numel()), dtype=torch.int64,
                                        pin_memory=self.device.type == "cuda")
        return self._staging.numpy()[:n]

    def forget(self, request_id: str) -> None:
        """The request finished: its block table row is free again."""
        self.state.forget(request_id)

    def prepare(self, requests: Sequence[ScheduledRequestData]) -> StepInputs:
        bs, num_reqs = self.block_size, len(requests)
        rows = self.state.apply(requests)  # [B] rows of the persistent block tables
        # [B, 4]: chunk length, first position, rows it asks to sample, whether it samples (one array: at
        # batch 1 every numpy call is host time before the step's first kernel)
        meta = np.array([(len(r.token_ids), r.start_pos, r.num_sample_rows, r.sample) for r in requests],
                        dtype=np.int64).reshape(num_reqs, 4)  # fmt: skip
        query_lens_np, start_np = meta[:, 0], meta[:, 1]  # [B], [B]
        n_sample = meta[:, 2] * meta[:, 3]  # [B] rows each request samples: 0 unless it samples
        bad = np.flatnonzero((n_sample > query_lens_np) | (n_sample < meta[:, 3]))  # a sampler asks 1 to its length
        if len(bad):
            r = requests[int(bad[0])]
            raise ValueError(f"request {r.request_id} samples {r.num_sample_rows} rows of a "
                             f"{len(r.token_ids)}-token chunk; use 1 to {len(r.token_ids)}")
        seq_lens_np = start_np + query_lens_np
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(query_lens_np, out=qsl[1:])
        num_tokens = int(qsl[-1])
        req_of = np.repeat(np.arange(num_reqs), query_lens_np)  # [T] the request of each token
        nb = self.state.num_blocks[rows]  # [B]
        max_blocks = int(nb.max())
        num_sample = int(n_sample.sum())
        table_end = 4 * num_tokens + num_reqs * max_blocks
        sample_end = table_end + num_sample
        # seq_lens [B] and query_start_loc [B + 1] as int32 (what the attention kernels read: no conversion
        # launches), each from a 16-byte boundary as a fresh tensor would be (Triton compiles a kernel once
        # per pointer alignment class: a new class mid-serving would be a compile there)
        lens_at = _even(sample_end)
        qsl_at = _even(lens_at + (num_reqs + 1) // 2)
        buf = self._staging_buffer(qsl_at + num_reqs // 2 + 1)
        buf[lens_at:].view(np.int32)[:num_reqs] = seq_lens_np
        buf[qsl_at:].view(np.int32)[: num_reqs + 1] = qsl
        ids, positions, slots, tags = (buf[i * num_tokens : (i + 1) * num_tokens] for i in range(4))
        tables = buf[4 * num_tokens : table_end].reshape(num_reqs, max_blocks)
        tables[:] = self.state.tables[rows, :max_blocks]
        if num_reqs > 1:  # past a request's own blocks: padding
            tables[np.arange(max_blocks)[None, :] >= nb[:, None]] = 0
        ids[:] = np.fromiter(chain.from_iterable(r.token_ids for r in requests), np.int64, num_tokens)
        np.add(np.arange(num_tokens) - qsl[req_of], start_np[req_of], out=positions)
        block_idx = positions // bs
        over = np.flatnonzero(block_idx >= nb[req_of])
        if len(over):
            r = requests[int(req_of[over[0]])]
            raise ValueError(f"request {r.request_id} feeds position {int(positions[over[0]])} but holds "
                             f"{int(nb[req_of[over[0]]])} blocks of {bs} tokens")
        np.add(tables[req_of, block_idx] * bs, positions % bs, out=slots)
        tags[:] = self.state.tags[rows[req_of], block_idx]
        # sampling rows: each sampling request's last n_sample rows, in row order
        if num_sample == num_tokens:  # every row samples (a decode or verify step)
            sample_req, sample_idx = req_of, np.arange(num_tokens)
        else:
            k = n_sample[n_sample > 0]  # [B'] rows each sampling request samples
            sample_req = np.repeat(np.flatnonzero(n_sample), k)  # [S]
            within = np.arange(num_sample) - np.repeat(np.cumsum(k) - k, k)  # [S] 0..k-1 per request
            sample_idx = qsl[sample_req + 1] - n_sample[sample_req] + within  # ascending: requests in row order
        buf[table_end:sample_end] = sample_idx
        sample_rows = [SampleRow(row, requests[b], pos + 1) for row, b, pos in
                       zip(sample_idx.tolist(), sample_req.tolist(), positions[sample_idx].tolist())]
        placeholder_rows = np.flatnonzero(ids == PLACEHOLDER_TOKEN)
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
            seq_lens_tensor=dev[lens_at:].view(torch.int32)[:num_reqs],
            query_start_loc_tensor=dev[qsl_at:].view(torch.int32)[: num_reqs + 1],
            positions_np=positions.copy(), slots_np=slots.copy(), tags_np=tags.copy(),
            query_start_loc=qsl.tolist(), query_lens=query_lens_np.tolist(), seq_lens=seq_lens_np.tolist(),
            sample_rows=sample_rows, placeholder_rows=placeholder_rows, placeholder_requests=req_of[placeholder_rows],
            state_rows=rows, sample_requests=sample_req,
        )


def _even(i: int) -> int:
    """i rounded up to even: an int64 index on a 16-byte boundary of the staging buffer."""
    return i + (i & 1)
