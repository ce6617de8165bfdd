"""All-to-all token dispatch for expert parallelism (`--moe-a2a-backend alltoall`): each rank sends each of
its tokens' (token, k) rows to the rank of that row's expert and gets the results back.

Shape legend: T = the step's tokens, H = hidden, K = experts per token, N = ranks, C = ceil(T / N),
S = this rank's rows (its tokens x K), M = the rows it receives.

    rank r owns tokens [r*C, min((r+1)*C, T))      every rank holds all T hidden states (TP attention)
    S rows, sorted by destination rank ──all_to_all──► M rows [M, H] + meta [M, 3] (weight, slot, row)
                                                       │ the experts (any backend, top-k 1 over M rows)
    S results, back in (token, k) order ◄──all_to_all── y [M, H]
    sum over k (fixed order) ──► [C, H] ──all_gather──► [T, H] every token's routed output on every rank

combine() returns the whole routed output (`complete`), so the MoE block adds its shared experts' reduced
partial sum instead of all-reducing the routed one. A token's rows are summed by its owner in k order,
whatever rank ran them: the bits of a token's output do not depend on N or on the placement.

Which replica a row runs on is LocalDispatch's rule (layers/expert_dispatch.py): token t's row for expert e
goes to replica t mod (e's replica count), the same on every rank. The meta carries the slot as the
expert rank's slot (never a logical id: the R3 capture happened before dispatch, layers/moe.py) and the
row's flat position token * K + k, both exact in float64, as is a float32 weight.

The collectives go through a DispatchGroup: TorchGroup is torch.distributed's default group (gloo on the
CPU: all_to_all_single and all_gather both run there; NCCL on CUDA); a test can give threads a group of
their own. The row counts are exchanged first (a host sync, like LocalDispatch's nonzero()): steps under
expert parallelism run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from fastdeploy_r3.model_executor.layers.expert_dispatch import DispatchedRows, LocalDispatch
from fastdeploy_r3.model_executor.layers.expert_placement import ExpertPlacement, ExpertPlacementError

BACKENDS = ("local", "alltoall")  # --moe-a2a-backend (SGLang's flag); local: LocalDispatch, no all-to-all


class DispatchGroup(Protocol):
    """The collectives the dispatch needs, over the expert-parallel ranks."""

    rank: int
    size: int

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        """Rows in_splits[j] of inp go to rank j; out receives out_splits[j] rows from rank j, in rank order."""
        ...

    def all_gather(self, out: list[torch.Tensor], inp: torch.Tensor) -> None:
        """out[j] = rank j's inp (the same shape on every rank)."""
        ...


class TorchGroup:
    """torch.distributed's default group: the workers' tensor-parallel group (distributed/parallel_state.py),
    which expert parallelism runs over."""

    def __init__(self) -> None:
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)

    def all_gather(self, out: list[torch.Tensor], inp: torch.Tensor) -> None:
        dist.all_gather(out, inp)


@dataclass
class DispatchBytes:
    """Bytes this rank sent to other ranks, by stage, since it started (rows a rank keeps cost nothing)."""

    calls: int = 0
    dispatch: int = 0  # hidden states + meta of the rows sent to their expert's rank (and the row counts)
    combine: int = 0  # the results sent back to their token's rank
    gather: int = 0  # this rank's [C, H] routed output sent to every other rank

    @property
    def total(self) -> int:
        return self.dispatch + self.combine + self.gather


@dataclass(frozen=True)
class ExchangedRows(DispatchedRows):
    """DispatchedRows received by all-to-all (rows: the flat token * K + k of each, over the whole step),
    and what combine() needs to send the results back."""

    order: torch.Tensor  # [S] int64: this rank's row i (its i-th (token, k) in order) was sent as order[i]
    send_counts: list[int]  # rows this rank sent to each rank
    recv_counts: list[int]  # rows each rank sent this rank
    first_token: int  # this rank's tokens are [first_token, first_token + owned_tokens)
    owned_tokens: int
    chunk: int  # C = ceil(T / N): the all-gather's rows per rank (the last ranks pad)


@dataclass
class AllToAllDispatch:
    """ExpertDispatch by all-to-all over `group` (an ExpertDispatch, layers/expert_dispatch.py)."""

    placement: ExpertPlacement
    group: DispatchGroup
    complete: bool = True  # combine() gives every token's whole routed output: no all-reduce after it
    bytes_sent: DispatchBytes = field(default_factory=DispatchBytes)

    def __post_init__(self) -> None:
        if self.group.size != self.placement.ep_size or self.group.rank != self.placement.ep_rank:
            raise ExpertPlacementError(
                f"the placement is rank {self.placement.ep_rank} of {self.placement.ep_size}, the group rank "
                f"{self.group.rank} of {self.group.size}: the all-to-all runs over the expert-parallel ranks"
            )
        self._local = LocalDispatch(self.placement)  # its replica tables: the same rule on every rank

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> ExchangedRows:
        num_tokens, top_k = topk_ids.shape
        size, rank, device = self.group.size, self.group.rank, x.device
        chunk = -(-num_tokens // size)
        first = min(rank * chunk, num_tokens)
        owned = min(first + chunk, num_tokens) - first
        num_replicas, replica_rank, replica_slot = self._local._tables_on(device)
        ids = topk_ids[first : first + owned]  # [owned, K]
        token = torch.arange(first, first + owned, device=device).unsqueeze(1)  # [owned, 1] step-wide token ids
        replica = token % num_replicas[ids]  # [owned, K]
        dest = replica_rank[ids, replica].reshape(-1)  # [S]
        order = torch.sort(dest, stable=True).indices  # [S]: by destination rank, (token, k) order within
        send_counts = torch.bincount(dest, minlength=size).tolist()
        recv = torch.empty(size, dtype=torch.int64, device=device)
        self.group.all_to_all(recv, torch.tensor(send_counts, dtype=torch.int64, device=device), [1] * size,
                              [1] * size)
        recv_counts = recv.tolist()
        flat = (token * top_k + torch.arange(top_k, device=device)).reshape(-1)  # [S] step-wide row ids
        meta = torch.stack([
            topk_weights[first : first + owned].reshape(-1).double(),
            replica_slot[ids, replica].reshape(-1).double(),
            flat.double(),
        ], dim=1).index_select(0, order)  # [S, 3]
        rows_x = x.index_select(0, first + order // top_k)  # [S, H] the token of each row, in send order
        got_x = x.new_empty(sum(recv_counts), x.shape[1])  # [M, H]
        got_meta = meta.new_empty(sum(recv_counts), 3)  # [M, 3]
        self.group.all_to_all(got_x, rows_x, recv_counts, send_counts)
        self.group.all_to_all(got_meta, meta, recv_counts, send_counts)
        away = sum(send_counts) - send_counts[rank]
        self.bytes_sent.calls += 1
        self.bytes_sent.dispatch += away * (x.shape[1] * x.element_size() + 3 * 8) + (size - 1) * 8
        return ExchangedRows(
            x=got_x, topk_weights=got_meta[:, 0:1].float(), slots=got_meta[:, 1:2].long(),
            rows=got_meta[:, 2].long(), num_tokens=num_tokens, top_k=top_k, order=order,
            send_counts=send_counts, recv_counts=recv_counts, first_token=first, owned_tokens=owned, chunk=chunk,
        )

    def combine(self, y: torch.Tensor, rows: DispatchedRows) -> torch.Tensor:
        """y [M, H] (weighted) -> [T, H]: every token's rows summed over k in a fixed order by its owner, in
        float32 as the fused backends accumulate, then gathered onto every rank."""
        assert isinstance(rows, ExchangedRows), type(rows)
        size, rank, hidden = self.group.size, self.group.rank, y.shape[1]
        back = y.new_empty(sum(rows.send_counts), hidden)  # [S, H] in send order
        self.group.all_to_all(back, y.contiguous(), rows.send_counts, rows.recv_counts)
        part = torch.zeros(back.shape[0], hidden, dtype=torch.float32, device=y.device)  # [S, H]
        part.index_copy_(0, rows.order, back.float())  # (token, k) order
        own = part.view(rows.owned_tokens, rows.top_k, hidden).sum(dim=1).to(y.dtype)  # [owned, H]
        padded = y.new_zeros(rows.chunk, hidden)  # [C, H]
        padded[: rows.owned_tokens] = own
        gathered = [torch.empty_like(padded) for _ in range(size)]
        self.group.all_gather(gathered, padded)
        away = sum(rows.recv_counts) - rows.recv_counts[rank]
        self.bytes_sent.combine += away * hidden * y.element_size()
        self.bytes_sent.gather += (size - 1) * rows.chunk * hidden * y.element_size()
        return torch.cat(gathered)[: rows.num_tokens]  # [T, H]


def use_moe_a2a_backend(model: nn.Module, backend: str, group: DispatchGroup | None = None) -> None:
    """Give every expert-parallel MoE layer of `model` the dispatch `backend` names (BACKENDS): "local"
    keeps LocalDispatch, "alltoall" installs an AllToAllDispatch over `group` (torch.distributed's default
    group when None). A model without expert parallelism (every layer holds every expert) is refused."""
    from fastdeploy_r3.model_executor.layers.moe import StackedExperts

    if backend not in BACKENDS:
        raise ValueError(f"moe_a2a_backend={backend!r}; use one of {', '.join(BACKENDS)}")
    layers = [m for m in model.modules() if isinstance(m, StackedExperts) and m.dispatch is not None]
    if backend == "alltoall" and not layers:
        raise ExpertPlacementError("moe_a2a_backend='alltoall' needs expert parallelism (--enable-expert-parallel)")
    for m in layers:
        m.dispatch = (AllToAllDispatch(m.placement, group or TorchGroup()) if backend == "alltoall"
                      else LocalDispatch(m.placement))
