"""Which rank holds which routed expert, and where in that rank's stacked weights.

    logical expert e (what the router picks, what R3 records)
        ──► rank  expert_rank[e]                         of the expert-parallel group
        ──► slot  local_experts.index(e)                 in that rank's w13 / w2 [slots, ...]

    identity(4):               expert_rank = (0, 0, 0, 0)    rank 0 holds slots 0..3 = experts 0..3
    two ranks, round robin:    expert_rank = (0, 1, 0, 1)    rank 1 holds slots 0, 1 = experts 1, 3

Without expert parallelism every model uses the identity (tensor parallelism splits every expert on I
instead). Expert parallelism over N ranks uses contiguous(E, N, r): rank r holds experts
[r*E/N, (r+1)*E/N) whole, and the MoE layer dispatches each token to the ranks of its experts
(layers/expert_dispatch.py); the router and the R3 capture see only logical ids, and the loader reads
only this rank's experts.

Redundant experts (EPLB): redundant(physical_to_logical, N, r) has P >= E physical slots, P/N
consecutive ones per rank, slot p holding logical expert physical_to_logical[p]; a hot expert has
several replicas (replicas(e): (rank, slot) of each, in physical order) and the dispatch spreads its
tokens over them. expert_rank[e] is then the rank of e's first replica.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# a routed expert's checkpoint tensor: `<layer>.mlp.experts.<e>.<proj>.weight` (Qwen3-MoE, GLM-4.5) or
# `<layer>.block_sparse_moe.experts.<e>.<proj>.weight` (Mixtral), and an fp8 expert's weight_scale_inv; the
# names MoeCausalLM.holds_checkpoint_weight (models/base.py) skips for another rank's experts
_ROUTED_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.\w+\.(?:weight|weight_scale_inv)$")


def routed_expert_of(ckpt_name: str) -> int | None:
    """The logical expert a checkpoint tensor belongs to, None for every other tensor (GLM's shared experts
    included: `shared_experts.` is not `.experts.`)."""
    m = _ROUTED_EXPERT_TENSOR.search(ckpt_name)
    return None if m is None else int(m.group(1))


class ExpertPlacementError(ValueError):
    """A placement that cannot be built, or one the MoE layer cannot run."""


@dataclass(frozen=True)
class ExpertPlacement:
    expert_rank: tuple[int, ...]  # [E] expert-parallel rank holding each logical expert (its first replica)
    ep_rank: int = 0  # this rank
    # [P] EPLB: the logical expert of each physical slot, P/N consecutive slots per rank; () = one replica each
    physical_to_logical: tuple[int, ...] = ()
    num_ranks: int = 0  # the expert-parallel size; 0: max(expert_rank) + 1
    _slots: dict[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _local: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _replicas: tuple[tuple[tuple[int, int], ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.expert_rank:
            raise ExpertPlacementError("an expert placement needs at least one expert")
        if min(self.expert_rank) < 0:
            raise ExpertPlacementError(f"expert_rank {self.expert_rank} holds a negative rank")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ExpertPlacementError(f"ep_rank {self.ep_rank} is not a rank of {self.expert_rank}")
        replicas: list[list[tuple[int, int]]] = [[] for _ in self.expert_rank]
        if self.physical_to_logical:
            per_rank = len(self.physical_to_logical) // self.ep_size
            for p, e in enumerate(self.physical_to_logical):
                replicas[e].append((p // per_rank, p % per_rank))
        else:
            next_slot = [0] * self.ep_size
            for e, rank in enumerate(self.expert_rank):
                replicas[e].append((rank, next_slot[rank]))
                next_slot[rank] += 1
        local = sorted((slot, e) for e, reps in enumerate(replicas) for rank, slot in reps if rank == self.ep_rank)
        if not local:
            raise ExpertPlacementError(f"rank {self.ep_rank} holds no expert in {self.expert_rank}")
        slots: dict[int, tuple[int, ...]] = {}
        for slot, e in local:
            slots[e] = (*slots.get(e, ()), slot)
        object.__setattr__(self, "_slots", slots)
        object.__setattr__(self, "_local", tuple(e for _, e in local))
        object.__setattr__(self, "_replicas", tuple(tuple(r) for r in replicas))

    @classmethod
    def identity(cls, num_experts: int) -> ExpertPlacement:
        """One rank holds every expert, slot e = expert e."""
        return cls(expert_rank=(0,) * num_experts)

    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int, ep_rank: int) -> ExpertPlacement:
        """Rank r holds experts [r*E/N, (r+1)*E/N) in slots 0..E/N-1: the usual expert-parallel default."""
        if ep_size < 1 or num_experts % ep_size:
            raise ExpertPlacementError(f"{num_experts} experts do not split evenly over {ep_size} expert-parallel "
                                       "ranks; use an expert-parallel size that divides the expert count")
        per_rank = num_experts // ep_size
        return cls(expert_rank=tuple(e // per_rank for e in range(num_experts)), ep_rank=ep_rank)

    @classmethod
    def redundant(
        cls, physical_to_logical: tuple[int, ...], num_experts: int, ep_size: int, ep_rank: int
    ) -> ExpertPlacement:
        """EPLB: physical slot p (P/N consecutive per rank) holds logical expert physical_to_logical[p]."""
        p2l = tuple(int(e) for e in physical_to_logical)
        if ep_size < 1 or not p2l or len(p2l) % ep_size:
            raise ExpertPlacementError(f"{len(p2l)} physical expert slots do not split evenly over {ep_size} ranks; "
                                       "give a multiple of the expert-parallel size")
        bad = [e for e in p2l if not 0 <= e < num_experts]
        if bad:
            raise ExpertPlacementError(f"physical_to_logical names expert {bad[0]}, outside [0, {num_experts})")
        missing = sorted(set(range(num_experts)) - set(p2l))
        if missing:
            raise ExpertPlacementError(f"physical_to_logical holds no replica of expert {missing[0]}; every logical "
                                       "expert needs at least one physical slot")
        per_rank = len(p2l) // ep_size
        first_rank = tuple(p2l.index(e) // per_rank for e in range(num_experts))
        return cls(expert_rank=first_rank, ep_rank=ep_rank, physical_to_logical=p2l, num_ranks=ep_size)

    @property
    def num_experts(self) -> int:
        return len(self.expert_rank)

    @property
    def ep_size(self) -> int:
        return self.num_ranks or max(self.expert_rank) + 1

    @property
    def local_experts(self) -> tuple[int, ...]:
        """This rank's logical expert of each slot, in slot order (a replicated expert may appear twice)."""
        return self._local

    @property
    def num_local_experts(self) -> int:
        """Slots on this rank."""
        return len(self._local)

    @property
    def is_identity(self) -> bool:
        """Slot e holds logical expert e for every expert: topk_ids index the stacked weights directly."""
        return self._local == tuple(range(self.num_experts))

    def replicas(self, expert: int) -> tuple[tuple[int, int], ...]:
        """(rank, slot) of each replica of logical `expert`, in physical order."""
        return self._replicas[expert]

    def local_slots(self, expert: int) -> tuple[int, ...]:
        """This rank's slots holding logical `expert` (empty where only other ranks do)."""
        if not 0 <= expert < self.num_experts:
            raise ExpertPlacementError(f"expert {expert} is outside [0, {self.num_experts})")
        return self._slots.get(expert, ())

    def holds_checkpoint_tensor(self, ckpt_name: str) -> bool:
        """False only for a routed expert's tensor that no slot of this rank holds: what a weight update need
        not deliver to this rank (engine/control.py)."""
        expert = routed_expert_of(ckpt_name)
        return expert is None or not 0 <= expert < self.num_experts or bool(self._slots.get(expert))

    def local_slot(self, expert: int) -> int | None:
        """First slot of logical `expert` on this rank, None where another rank holds it."""
        slots = self.local_slots(expert)
        return slots[0] if slots else None
