"""EPLB from measured load: a new placement of the same physical slots, and the weight moves it takes.

    recorded load [L][E] (layers/expert_load.py) ──rebalanced_placement──► physical_to_logical [P]
    each rank: move_experts(model, physical_to_logical, group)  its slots refilled, the dispatch rebuilt

The placement (one map for every MoE layer, as a placement file gives it: the summed load of the
layers decides) is a greedy in two passes, deterministic on every rank and in the engine:

1. replicas: every logical expert gets one slot; each of the R = P - E extra slots goes, one at a time,
   to the expert whose load per replica is highest (ties: the lower id). The dispatch spreads an
   expert's rows evenly over its replicas (token t to replica t mod n, layers/expert_dispatch.py), so
   load / replicas is what each replica will carry.
2. ranks: the replicas, heaviest share first (ties: the lower id), each to the rank with the least load
   so far among those with a free slot, preferring one that does not already hold the expert (ties:
   the lower rank). A rank's slots are then ordered by logical id.

Weights move between ranks, not from the checkpoint: after a weight update from a trainer's broadcast
or from tensors, the current version exists nowhere on disk, and the ranks together always hold every
logical expert of the current version (a rebalance never leaves one without a replica). For each
logical expert some rank newly needs, the rank holding its first old replica broadcasts it over the
expert-parallel group (every parameter with a slot dimension, every layer stacked: one collective per
expert and parameter, in expert order, so every rank takes part in the same ones). Each rank then
writes its slots in place (the parameters keep their storage: CUDA graphs that read them stay valid).
The logical weights are unchanged, so the weight version and every cached prefix stay valid, and R3
still records the router's logical ids.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fastdeploy_r3.model_executor.layers.expert_placement import ExpertPlacement, ExpertPlacementError


def rebalanced_placement(load: list[int], num_ranks: int, slots_per_rank: int) -> tuple[int, ...]:
    """physical_to_logical [num_ranks * slots_per_rank] for per-expert `load` (rows routed to each)."""
    num_experts = len(load)
    extra = num_ranks * slots_per_rank - num_experts
    if extra < 0:
        raise ExpertPlacementError(f"{num_ranks} ranks of {slots_per_rank} slots cannot hold {num_experts} experts")
    replicas = [1] * num_experts
    for _ in range(extra):
        hottest = max(range(num_experts), key=lambda e: (load[e] / replicas[e], -e))
        replicas[hottest] += 1
    shares = sorted(((load[e] / replicas[e], e) for e in range(num_experts) for _ in range(replicas[e])),
                    key=lambda s: (-s[0], s[1]))
    rank_load = [0.0] * num_ranks
    slots: list[list[int]] = [[] for _ in range(num_ranks)]
    for share, e in shares:
        free = [r for r in range(num_ranks) if len(slots[r]) < slots_per_rank]
        rank = min([r for r in free if e not in slots[r]] or free, key=lambda r: (rank_load[r], r))
        slots[rank].append(e)
        rank_load[rank] += share
    return tuple(e for rank_slots in slots for e in sorted(rank_slots))


def _stacked_experts(model: nn.Module) -> list[nn.Module]:
    """Every layer's experts, a draft (MTP) layer's included: the model's checkpoint filter
    (holds_checkpoint_weight) follows one placement, so every layer moves to it."""
    from fastdeploy_r3.model_executor.layers.moe import StackedExperts

    return [m for m in model.modules() if isinstance(m, StackedExperts)]


def move_experts(model: nn.Module, physical_to_logical: tuple[int, ...],
                 broadcast: Callable[[torch.Tensor, int], None]) -> int:  # fmt: skip
    """Give this rank the slots of `physical_to_logical` (same slot count as now), weights from the ranks that
    hold them; broadcast(tensor, src) is the expert-parallel group's (every rank calls this together).
    Returns the bytes this rank received."""
    layers = _stacked_experts(model)
    old: ExpertPlacement = layers[0].placement
    if any(m.placement != old for m in layers):
        raise ExpertPlacementError("the MoE layers hold different placements; a rebalance moves one shared map")
    new = ExpertPlacement.redundant(physical_to_logical, old.num_experts, old.ep_size, old.ep_rank)
    if new.num_local_experts != old.num_local_experts:
        raise ExpertPlacementError(f"the new placement gives rank {old.ep_rank} {new.num_local_experts} slots, it has "
                                   f"{old.num_local_experts}: a rebalance keeps the number of physical slots")
    names = [n for n, p in layers[0].named_parameters(recurse=False) if p.shape[:1] == (old.num_local_experts,)]
    received: dict[tuple[int, str], torch.Tensor] = {}  # (expert, name) -> [L, ...] every layer's copy
    nbytes = 0
    for e in range(old.num_experts):
        needed = [r for r in range(old.ep_size) if _needs(old, new, e, r)]
        if not needed:
            continue
        src, src_slot = old.replicas(e)[0]
        for name in names:
            if old.ep_rank == src:
                buf = torch.stack([getattr(m, name)[src_slot] for m in layers])  # [L, ...]
            else:
                p = getattr(layers[0], name)
                buf = torch.empty((len(layers), *p.shape[1:]), dtype=p.dtype, device=p.device)
            broadcast(buf.view(torch.uint8), src)  # as bytes: fp8 weights travel where a backend lacks the dtype
            if old.ep_rank in needed:
                received[(e, name)] = buf
                nbytes += buf.numel() * buf.element_size() if old.ep_rank != src else 0
    for i, m in enumerate(layers):
        for name in names:
            param = getattr(m, name)
            rows = []
            for e in new.local_experts:
                have = old.local_slots(e)
                rows.append(param[have[0]] if have else received[(e, name)][i])
            param.data.copy_(torch.stack(rows))  # in place: the storage (and any graph reading it) stays
        m.placement = new
        m.dispatch = _rebuilt(m.dispatch, new)
    model.expert_placement = new
    return nbytes


def _needs(old: ExpertPlacement, new: ExpertPlacement, expert: int, rank: int) -> bool:
    """Whether `rank` holds `expert` after the move but not before (then someone must send it)."""
    holds_new = any(r == rank for r, _ in new.replicas(expert))
    holds_old = any(r == rank for r, _ in old.replicas(expert))
    return holds_new and not holds_old


def _rebuilt(dispatch: object, placement: ExpertPlacement) -> object:
    """The same kind of dispatch over the new placement (its replica tables change)."""
    from fastdeploy_r3.model_executor.layers.expert_alltoall import AllToAllDispatch
    from fastdeploy_r3.model_executor.layers.expert_dispatch import LocalDispatch

    if isinstance(dispatch, AllToAllDispatch):
        return AllToAllDispatch(placement, dispatch.group)
    return LocalDispatch(placement)
