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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

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
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.routing_capture = routing_capture
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = [s for s in GRAPH_BATCH_SIZES if s <= max_num_seqs]
        if not self.sizes or self.sizes[-1] < max_num_seqs:
            self.sizes.append(max_num_seqs)  # the engine never schedules more than max_num_seqs requests
        n = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [N]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [N]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)  # [N]
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int64, device=device)  # [N, MB]
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)  # [N]
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [N + 1]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # [P, V] float32, the graphs' outputs

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=list(range(size + 1)),
            query_lens=[1] * size,
            seq_lens=[0] * size,  # host lists are not read under a graph; the tensors below are
            block_tables=self.block_tables[:size],
            block_size=self.block_size,
            seq_lens_tensor=self.seq_lens[:size],
            query_start_loc_tensor=self.query_start_loc[: size + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, size: int) -> torch.Tensor:
        capture = self.routing_capture
        with set_forward_context(ForwardContext(self._metadata(size), self.kv_caches, capture)):
            if capture is not None:
                capture.begin_step(size, self.positions[:size])
            hidden = self.model(self.input_ids[:size], self.positions[:size])  # [P, H]
            if capture is not None:
                capture.check_complete()
            return self.model.compute_logits(hidden)  # [P, V]

    @torch.inference_mode()
    @graph_kernels()
    def capture(self) -> None:
        """Record one graph per size, largest first (the smaller ones reuse its memory pool)."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(size)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, requests: Sequence[ScheduledRequestData], table_width: int) -> bool:
        """A pure decode step (one token per request, each sampling) that fits the captured capacity;
        table_width: the step's widest block table (StepInputs.block_tables' width)."""
        return (
            padded_size(len(requests), self.sizes) is not None
            and all(len(r.token_ids) == 1 and r.sample for r in requests)
            and table_width <= self.max_blocks
        )

    def replay(self, inp: StepInputs) -> torch.Tensor:
        """Run the step's B rows through graph P; returns logits [B, V] (a view of the graph's output)."""
        num_reqs = inp.num_tokens  # one token per request
        size = padded_size(num_reqs, self.sizes)
        assert size is not None, "can_run() first"
        width = inp.block_tables.shape[1]
        self.input_ids[:num_reqs].copy_(inp.input_ids)
        self.positions[:num_reqs].copy_(inp.positions)
        self.slot_mapping[:num_reqs].copy_(inp.slot_mapping)
        self.slot_mapping[num_reqs:size].fill_(-1)
        self.block_tables[:num_reqs, :width].copy_(inp.block_tables)
        self.seq_lens[:num_reqs].copy_(inp.seq_lens_tensor)
        self.seq_lens[num_reqs:size].fill_(0)
        self.graphs[size].replay()
        return self.logits[size][:num_reqs]
