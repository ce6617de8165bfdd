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
"""

from __future__ import annotations

from dataclasses import dataclass, field


class ExpertPlacementError(ValueError):
    """A placement that cannot be built, or one the MoE layer cannot run."""


@dataclass(frozen=True)
class ExpertPlacement:
    expert_rank: tuple[int, ...]  # [E] expert-parallel rank holding each logical expert
    ep_rank: int = 0  # this rank
    _slots: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.expert_rank:
            raise ExpertPlacementError("an expert placement needs at least one expert")
        if min(self.expert_rank) < 0:
            raise ExpertPlacementError(f"expert_rank {self.expert_rank} holds a negative rank")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ExpertPlacementError(f"ep_rank {self.ep_rank} is not a rank of {self.expert_rank}")
        local = [e for e, rank in enumerate(self.expert_rank) if rank == self.ep_rank]
        if not local:
            raise ExpertPlacementError(f"rank {self.ep_rank} holds no expert in {self.expert_rank}")
        object.__setattr__(self, "_slots", {e: slot for slot, e in enumerate(local)})

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

    @property
    def num_experts(self) -> int:
        return len(self.expert_rank)

    @property
    def ep_size(self) -> int:
        return max(self.expert_rank) + 1

    @property
    def local_experts(self) -> tuple[int, ...]:
        """This rank's logical expert ids, in slot order."""
        return tuple(self._slots)

    @property
    def num_local_experts(self) -> int:
        return len(self._slots)

    @property
    def is_identity(self) -> bool:
        """Slot e holds logical expert e for every expert: topk_ids index the stacked weights directly."""
        return self.num_local_experts == self.num_experts

    def local_slot(self, expert: int) -> int | None:
        """Slot of logical `expert` on this rank, None where another rank holds it."""
        if not 0 <= expert < self.num_experts:
            raise ExpertPlacementError(f"expert {expert} is outside [0, {self.num_experts})")
        return self._slots.get(expert)
