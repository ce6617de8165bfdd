"""Token dispatch and combine for expert parallelism: which of a step's (token, k) rows run on this rank.

Shape legend: T = tokens, H = hidden, K = experts per token, E = logical experts, N = this rank's rows.

    topk_ids [T, K] logical ──dispatch──► x [N, H], weights [N, 1], slots [N, 1] local   (this rank's experts)
                                              │ the experts (any backend, top-k 1 over N rows)
    [T, H] this rank's partial ◄──combine──── y [N, H]
                                              │ SparseMoeBlock's all-reduce (with the shared experts)
    [T, H] every expert of every token

LocalDispatch is the dispatch of expert parallelism over the tensor-parallel ranks: attention is TP, so
every rank already holds every token's hidden state and sends nothing; it keeps the rows whose expert
it holds, and the combine is the all-reduce the MoE block does anyway. A dispatch where ranks hold
different tokens (data-parallel attention) replaces it behind the same two calls: AllToAllDispatch
(layers/expert_alltoall.py, `--moe-a2a-backend alltoall`) sends each row to its expert's rank by an
all-to-all and combine() sends the results back, adds them per token and gathers every token's output;
a DeepEP-style kernel would be another.

Two shapes of LocalDispatch's rows, bit for bit the same result (tests/model_executor/test_expert_dispatch.py):

    compact      N = this rank's rows, cut by a nonzero(): a host sync (the CPU's choice: fewer rows to run)
    fixed-shape  N = T * K, every (token, k) row kept: another rank's row gets weight 0 and slot 0 (a valid
                 slot, so any backend runs it) and `keep` False, and combine() zeroes it (torch.where, not
                 the weight: 0 * inf would be NaN). No host sync and shapes fixed by T: CUDA graphs can
                 capture it (worker/model_runner.py captures EP decode steps).

On CUDA the fixed shape runs every step of up to FIXED_SHAPE_MAX_TOKENS tokens (decode, graph-replayed or
eager alike, so both run the same kernels on the same shapes) and every step under a graph capture;
larger steps (prefill) keep the compact rows: there each rank would otherwise run N times its share of
expert rows, while one host sync per layer costs little next to the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from fastdeploy_r3.model_executor.layers.expert_placement import ExpertPlacement


@dataclass(frozen=True)
class DispatchedRows:
    """The (token, k) rows one rank computes, and where their results go back."""

    x: torch.Tensor  # [N, H] hidden state of each row's token
    topk_weights: torch.Tensor  # [N, 1] the router's weight of the row's expert
    slots: torch.Tensor  # [N, 1] int64 the row's expert as this rank's slot (never a logical id)
    rows: torch.Tensor  # [N] int64 flat position token * K + k of each row, ascending
    num_tokens: int
    top_k: int
    # fixed-shape rows: [T * K] bool, this rank's rows (combine() zeroes the others); None: compact rows
    keep: torch.Tensor | None = field(default=None, kw_only=True)


class ExpertDispatch(Protocol):
    """dispatch() gives this rank its rows of a step; combine() turns their results into this rank's
    [T, H] contribution, which the MoE block sums over ranks, or (complete) into every token's whole
    routed output, which it does not."""

    complete: bool

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> DispatchedRows: ...

    def combine(self, y: torch.Tensor, rows: DispatchedRows) -> torch.Tensor: ...


FIXED_SHAPE_MAX_TOKENS = 512  # CUDA steps of at most this many tokens run fixed-shape rows (decode sizes)


class LocalDispatch:
    """Expert parallelism over TP ranks: every rank has every token; it runs the rows of its own experts."""

    complete = False  # combine() gives this rank's partial sum: the MoE block all-reduces it

    def __init__(self, placement: ExpertPlacement, fixed_shape: bool | None = None) -> None:
        self.placement = placement
        self.fixed_shape = fixed_shape  # None: fixed-shape rows on CUDA for decode-sized steps, else compact
        reps = [placement.replicas(e) for e in range(placement.num_experts)]
        width = max(len(r) for r in reps)
        # [E] replicas of each logical expert; [E, R] their ranks and slots (padded with the first replica)
        self._tables = (
            torch.tensor([len(r) for r in reps], dtype=torch.int64),
            torch.tensor([[rank for rank, _ in r] + [r[0][0]] * (width - len(r)) for r in reps], dtype=torch.int64),
            torch.tensor([[slot for _, slot in r] + [r[0][1]] * (width - len(r)) for r in reps], dtype=torch.int64),
        )
        self._on_device: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def _tables_on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        tables = self._on_device.get(device)
        if tables is None:
            tables = self._on_device[device] = tuple(t.to(device) for t in self._tables)
        return tables

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> DispatchedRows:
        """Token t's row for expert e runs on replica t mod (e's replica count): a fixed spread over replicas
        (EPLB) that every rank computes alike; with one replica each, on the expert's rank."""
        num_tokens, top_k = topk_ids.shape
        num_replicas, replica_rank, replica_slot = self._tables_on(topk_ids.device)
        token = torch.arange(num_tokens, device=topk_ids.device).unsqueeze(1)  # [T, 1]
        replica = token % num_replicas[topk_ids]  # [T, K]
        mine = replica_rank[topk_ids, replica] == self.placement.ep_rank  # [T, K]
        fixed = self.fixed_shape
        if fixed is None:
            small = num_tokens <= FIXED_SHAPE_MAX_TOKENS
            fixed = topk_ids.is_cuda and (small or torch.cuda.is_current_stream_capturing())
        if fixed:
            keep = mine.reshape(-1)  # [T * K]
            return DispatchedRows(
                x=x.repeat_interleave(top_k, dim=0),  # [T * K, H]
                topk_weights=torch.where(mine, topk_weights, 0).reshape(-1, 1),  # [T * K, 1], 0: another rank's
                slots=torch.where(mine, replica_slot[topk_ids, replica], 0).reshape(-1, 1),  # [T * K, 1] valid slots
                rows=torch.arange(num_tokens * top_k, device=x.device), num_tokens=num_tokens, top_k=top_k, keep=keep,
            )
        slots = torch.where(mine, replica_slot[topk_ids, replica], -1).reshape(-1)  # [T * K], -1: another rank's
        rows = torch.nonzero(slots >= 0).squeeze(1)  # [N] ascending
        return DispatchedRows(
            x=x.index_select(0, rows // top_k),  # [N, H]
            topk_weights=topk_weights.reshape(-1).index_select(0, rows).unsqueeze(1),  # [N, 1]
            slots=slots.index_select(0, rows).unsqueeze(1),  # [N, 1]
            rows=rows, num_tokens=num_tokens, top_k=top_k,
        )

    def combine(self, y: torch.Tensor, rows: DispatchedRows) -> torch.Tensor:
        """y [N, H] (weighted) -> [T, H]: each token's rows summed over k in a fixed order (no atomics, so
        the same bits on every run), in float32 as the fused backends accumulate."""
        hidden = y.shape[1]
        if rows.keep is not None:  # fixed shape: every row is here, the other ranks' zeroed
            part = torch.where(rows.keep.unsqueeze(1), y.float(), 0.0)  # [T * K, H]
            return part.view(rows.num_tokens, rows.top_k, hidden).sum(dim=1).to(y.dtype)  # [T, H]
        part = torch.zeros(rows.num_tokens * rows.top_k, hidden, dtype=torch.float32, device=y.device)
        part.index_copy_(0, rows.rows, y.float())  # [T * K, H], zero for other ranks' rows
        return part.view(rows.num_tokens, rows.top_k, hidden).sum(dim=1).to(y.dtype)  # [T, H]
