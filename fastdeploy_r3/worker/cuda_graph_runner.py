"""CUDA graphs of the decode step (forward + logits) at padded batch sizes, captured at start-up.

Shape legend: B = requests in the step (one token each), P = the padded size whose graph runs (>= B),
N = the largest captured size, MB = block-table capacity (max_model_len / block_size), V = vocabulary.

    static inputs (one set, sized N; graph P reads the first P rows):
        input_ids, positions, slot_mapping [N]    rows >= B: slot -1 (no KV write)
        block_tables [N, MB], seq_lens [N]        rows >= B: seq_len 0 (attention writes zeros)
        query_start_loc [N + 1] = 0, 1, ..., N    one token per row, fixed
    replay(B):  copy the step's B rows in, mark rows B..P padded, replay graph P -> logits [P, V],
                hand back logits[:B]

The R3 capture kernel is inside the graph and writes the step buffer's first P rows (step-local).
Only the B real rows ever leave it: the runner scatters capture.device_rows(B) at the step's B slots,
so padded rows never reach routing_host_buffer, and publish-after-write holds as in the eager path.

A graph bakes in every pointer it read at capture, so everything it touches lives as long as it does:
the static inputs here, the model's weights, the KV cache and the routing capture's step buffer.
Graphs are only captured when the attention backend can run on fixed-capacity device metadata
(`attention_is_graph_safe`); otherwise every step stays eager.

Verify steps of speculative decoding (engine/speculative.py: each request feeds its last token and up
to k drafts, and every one of them samples) replay graphs of query length Q = k + 1 too. Row b owns the
Q token slots [b*Q, (b+1)*Q) and puts its q_b real tokens LAST in them:

    row b:  [ pad .. pad | t_0 .. t_{q_b - 1} ]     seq_lens[b] = its context including t_{q_b - 1}

so the attention kernel, which reads a row's queries as the last Q positions of its context, sees
every real token at its true position. Pad slots write no KV (slot -1) and read only context the row
already has; their hidden states, logits and routing rows are never read: `verify_layout` maps each
packed token to its slot, and replay() hands back the sampling rows' logits and gathers the real
tokens' R3 rows to the front of the capture buffer, in packed order, before anything is written.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from fastdeploy_r3.model_executor.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from fastdeploy_r3.model_executor.layers.attention import Attention
from fastdeploy_r3.model_executor.layers.fused_moe import graph_kernels
from fastdeploy_r3.worker.input_batch import StepInputs
from fastdeploy_r3.worker.messages import ScheduledRequestData

logger = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def attention_is_graph_safe(model: nn.Module) -> bool:
    """True when every Attention module runs a backend that reads only device metadata of fixed capacity.

    A module whose backend is left to the device (None: the Triton kernels on CUDA) or whose backend says
    `cuda_graph_safe = True` qualifies; the torch reference backend (a Python loop over the requests'
    host-side lengths) does not.
    """
    if "seq_lens_tensor" not in AttentionMetadata.__dataclass_fields__:
        return False
    mods = [m for m in model.modules() if isinstance(m, Attention)]
    return bool(mods) and all(m.backend is None or getattr(m.backend, "cuda_graph_safe", False) for m in mods)


def padded_size(num_reqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size >= num_reqs, or None if the batch is larger than every graph."""
    return next((s for s in sizes if s >= num_reqs), None)


def verify_layout(query_lens: Sequence[int], q: int) -> np.ndarray:
    """Packed token t (rows back to back) -> its slot in a graph of query length q, where row b owns
    slots [b*q, (b+1)*q) and its query_lens[b] <= q tokens take the last ones. [T] int64."""
    lens = np.asarray(query_lens, dtype=np.int64)
    starts = np.cumsum(lens) - lens  # packed offset of each row's first token
    rows = np.arange(len(lens), dtype=np.int64)
    return np.repeat(rows * q + q - lens - starts, lens) + np.arange(int(lens.sum()), dtype=np.int64)


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        routing_capture,  # noqa: ANN001 (RoutingCapture | None)
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        verify_query_len: int = 1,
    ) -> None:
        """verify_query_len: k + 1 under speculative decoding (graphs for verify steps too), else 1."""
        self.model = model
        self.kv_caches = kv_caches
        self.routing_capture = routing_capture
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = [s for s in GRAPH_BATCH_SIZES if s <= max_num_seqs]
        if not self.sizes or self.sizes[-1] < max_num_seqs:
            self.sizes.append(max_num_seqs)  # the engine never schedules more than max_num_seqs requests
        n = self.sizes[-1]
        # (query length, sizes): verify graphs only where P * Q tokens fit the routing capture buffer
        rows = routing_capture.max_num_batched_tokens if routing_capture is not None else None
        self.query_sizes = {1: list(self.sizes)}
        if verify_query_len > 1:
            fit = [s for s in self.sizes if rows is None or s * verify_query_len <= rows]
            if fit:
                self.query_sizes[verify_query_len] = fit
        tokens = max(q * sizes[-1] for q, sizes in self.query_sizes.items())
        self.max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)  # [N * Q]
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)  # [N * Q]
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=device)  # [N * Q]
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int64, device=device)  # [N, MB]
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)  # [N]
        # row b's tokens start at b * Q: one fixed [N + 1] table per query length
        self.query_start_loc = {q: torch.arange(0, q * n + 1, q, dtype=torch.int32, device=device)
                                for q in self.query_sizes}  # fmt: skip
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (P, Q) -> graph
        self.logits: dict[tuple[int, int], torch.Tensor] = {}  # [P * Q, V] float32, the graphs' outputs
        self.hidden: dict[tuple[int, int], torch.Tensor] = {}  # [P * Q, H] their final hidden states
        self._last: tuple[tuple[int, int], torch.Tensor | None, int] | None = None  # hidden_of(): the last replay
        self.replays = dict.fromkeys(self.query_sizes, 0)  # steps replayed, by query length

    def _metadata(self, size: int, q: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: size * q],
            query_start_loc=list(range(0, size * q + 1, q)),
            query_lens=[q] * size,
            seq_lens=[0] * size,  # host lists are not read under a graph; the tensors below are
            block_tables=self.block_tables[:size],
            block_size=self.block_size,
            seq_lens_tensor=self.seq_lens[:size],
            query_start_loc_tensor=self.query_start_loc[q][: size + 1],
            max_query_len=q,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, size: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        capture, tokens = self.routing_capture, size * q
        with set_forward_context(ForwardContext(self._metadata(size, q), self.kv_caches, capture)):
            if capture is not None:
                capture.begin_step(tokens, self.positions[:tokens])
            hidden = self.model(self.input_ids[:tokens], self.positions[:tokens])  # [P * Q, H]
            if capture is not None:
                capture.check_complete()
            return hidden, self.model.compute_logits(hidden)  # [P * Q, H], [P * Q, V]

    @torch.inference_mode()
    @graph_kernels()
    def capture(self) -> None:
        """Record one graph per (size, query length), largest first (the smaller ones reuse its pool)."""
        pool = torch.cuda.graph_pool_handle()
        for q, sizes in sorted(self.query_sizes.items(), reverse=True):
            for size in reversed(sizes):
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._forward(size, q)  # warm-up: Triton compiles, cuBLAS picks its kernels
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.hidden[(size, q)], self.logits[(size, q)] = self._forward(size, q)
                self.graphs[(size, q)] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for (batch sizes) x query length: %s", self.query_sizes)

    def query_len_for(self, requests: Sequence[ScheduledRequestData], table_width: int) -> int | None:
        """The query length of the graph that runs this step, or None (eager): 1 for a pure decode step
        (one token per request, each sampling), Q for a verify step (every request feeds 1..Q tokens,
        all of them sampling), when the batch fits the captured capacity. table_width: the step's widest
        block table (StepInputs.block_tables' width)."""
        if table_width > self.max_blocks or not all(r.sample for r in requests):
            return None
        if all(len(r.token_ids) == 1 for r in requests):
            q = 1
        else:  # a verify step, when verify graphs were captured; a prefill chunk never is one
            q = max(self.query_sizes)
            if q == 1 or not all(len(r.token_ids) == r.num_sample_rows <= q for r in requests):
                return None
        return q if padded_size(len(requests), self.query_sizes[q]) is not None else None

    def replay(self, inp: StepInputs, q: int = 1) -> torch.Tensor:
        """Run the step's B rows through graph (P, q); returns the logits of its sampling rows [S, V] (when
        every row feeds q tokens, always so at q = 1, a view of the graph's output: every token samples)."""
        num_reqs = len(inp.query_lens)
        size = padded_size(num_reqs, self.query_sizes[q])
        assert size is not None, "query_len_for() first"
        width = inp.block_tables.shape[1]
        self.block_tables[:num_reqs, :width].copy_(inp.block_tables)
        self.seq_lens[:num_reqs].copy_(inp.seq_lens_tensor)
        self.seq_lens[num_reqs:size].fill_(0)
        self.replays[q] += 1
        tokens, n = size * q, inp.num_tokens
        if n == num_reqs * q:  # packed order is slot order: no layout (~0.15 ms of host time a verify step)
            self.input_ids[:n].copy_(inp.input_ids)
            self.positions[:n].copy_(inp.positions)
            self.slot_mapping[:n].copy_(inp.slot_mapping)
            self.slot_mapping[n:tokens].fill_(-1)  # padding rows: stale ids and positions, no KV, no R3 rows
            self.graphs[(size, q)].replay()
            self._last = ((size, q), None, n)
            return self.logits[(size, q)][:n]
        slots = torch.from_numpy(verify_layout(inp.query_lens, q)).to(inp.input_ids.device, non_blocking=True)
        self.input_ids[:tokens].zero_()
        self.input_ids.index_copy_(0, slots, inp.input_ids)
        self.positions[:tokens].zero_()
        self.positions.index_copy_(0, slots, inp.positions)
        self.slot_mapping[:tokens].fill_(-1)
        self.slot_mapping.index_copy_(0, slots, inp.slot_mapping)
        self.graphs[(size, q)].replay()
        self._last = ((size, q), slots, inp.num_tokens)
        capture = self.routing_capture
        if capture is not None:  # the real tokens' rows, in packed order, where the runner reads them
            capture.buffer[: inp.num_tokens].copy_(capture.buffer[slots])
        return self.logits[(size, q)][slots[inp.sample_idx]]

    def hidden_of(self) -> torch.Tensor:
        """The last replayed step's final hidden states in packed token order [T, H], a copy (the next
        replay overwrites the graph's output): what MTP drafts read (worker/mtp_drafter.py)."""
        assert self._last is not None, "replay() first"
        key, slots, num_tokens = self._last
        return self.hidden[key][:num_tokens].clone() if slots is None else self.hidden[key][slots]
