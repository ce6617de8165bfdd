"""The one scoped global: what a forward pass needs besides its inputs, entered with a context manager.

Layers read it instead of threading attention metadata, KV caches and the routing capture through
every module signature.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Batch layout of one step (B requests, T tokens, flattened request after request).

    token t of request b sits at position seq_lens[b] - query_lens[b] + (t - query_start_loc[b]);
    its K/V goes to slot_mapping[t] = block_tables[b, pos // block_size] * block_size + pos % block_size.
    """

    slot_mapping: torch.Tensor  # [T] int64, < 0 for a padded token (writes no KV)
    query_start_loc: list[int]  # [B + 1]
    query_lens: list[int]  # [B]   new tokens this step
    seq_lens: list[int]  # [B]   context length after this step (computed + new)
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    block_size: int

    # What graph-safe backends (Triton) read, all on block_tables' device. Left out, they are built from
    # the lists above. Under a CUDA graph the runner passes tensors of a fixed capacity B_max instead
    # (block_tables [B_max, max_blocks] too) and rewrites them in place before each replay; padded rows
    # have seq_len 0 (their tokens, if any, come out as zeros and write nothing).
    seq_lens_tensor: torch.Tensor | None = None  # [B] int32
    query_start_loc_tensor: torch.Tensor | None = None  # [B + 1] int32; query_start_loc[B] == T
    max_query_len: int | None = None  # host bound on query_lens: 1 selects the decode kernel
    max_seq_len: int | None = None  # host bound on seq_lens: sizes the decode splits (a graph: max_model_len)
    # tensors a backend derives from this step's layout at its first layer and every later layer reuses
    # (the metadata is built per forward, so they never outlive the step's layout or its graph capture)
    derived: dict[str, object] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        dev = self.block_tables.device
        if self.seq_lens_tensor is None:
            self.seq_lens_tensor = torch.tensor(self.seq_lens, dtype=torch.int32, device=dev)
        if self.query_start_loc_tensor is None:
            self.query_start_loc_tensor = torch.tensor(self.query_start_loc, dtype=torch.int32, device=dev)
        if self.max_query_len is None:
            self.max_query_len = max(self.query_lens, default=0)
        if self.max_seq_len is None:
            self.max_seq_len = max(self.seq_lens, default=0)


class RoutingCaptureSink(Protocol):
    def capture(self, moe_index: int, topk_ids: torch.Tensor) -> None:
        """Record the [T, K] top-k expert ids chosen by MoE layer number moe_index (0..L-1)."""


class StepBufferSink(Protocol):
    """A routing capture that lends its step buffer to a kernel that writes the ids itself (the fused
    routing kernel, ops/fused_routing.py), instead of receiving them through capture()."""

    def capture_buffer(self, moe_index: int, num_tokens: int) -> torch.Tensor:
        """The step buffer [max_tokens, L, K] whose rows [:num_tokens] of layer moe_index the caller writes
        before the step's rows are read; the layer counts as captured (same checks as capture())."""


@dataclass
class RoutingReplay:
    """Routing forced on every MoE layer (R3 replayed in a trainer's forward): topk_ids [T, L, K].

    Row t is the K experts token t uses in MoE layer number j (0..L-1, `moe_layer_ids` order); the
    router still computes the weights of those experts, so gradients reach it as in training.
    """

    topk_ids: torch.Tensor  # [T, L, K] int64

    def ids_for(self, moe_index: int, num_tokens: int) -> torch.Tensor:
        if self.topk_ids.shape[0] != num_tokens:
            raise ValueError(
                f"routing replay holds {self.topk_ids.shape[0]} rows but the forward has {num_tokens} tokens; "
                "pass one row per input token (R3 rows [T-1] replay a forward over tokens[:-1])"
            )
        return self.topk_ids[:, moe_index, :]  # [T, K]


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache) [NB, BS, KVH, D]
    routing_capture: RoutingCaptureSink | None = None
    routing_replay: RoutingReplay | None = None


_forward_context: ForwardContext | None = None


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _forward_context
    prev, _forward_context = _forward_context, ctx
    try:
        yield ctx
    finally:
        _forward_context = prev


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("no forward context; run the model inside set_forward_context(...)")
    return _forward_context
