"""The torch.distributed group a trainer and the engine's workers share for weight updates.

    trainer (rank 0) ─┐
    engine A worker r ─┼─ rendezvous tcp://{master_address}:{master_port}, keys prefixed by group_name
    engine B worker r ─┘   rank = rank_offset + tp_rank of that engine, world_size = 1 + all workers

The protocol is SGLang's `/init_weights_update_group` one (what slime and OpenRLHF-style trainers
speak): a TCP-store rendezvous whose keys are prefixed with the group name, then a process group of
the named backend — gloo on CPU, NCCL on CUDA. The group lives beside the workers' tensor-parallel
group (no default group is needed or touched), so an engine can join, leave and join again while
serving. Both sides call `init_weight_update_group`; the trainer then broadcasts from rank 0.
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


class WeightUpdateGroupError(RuntimeError):
    """A weight-update group cannot be joined or used; the message says what to change."""


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Join (rank > 0) or create (rank 0) the group; blocks until all world_size ranks arrived."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if backend not in BACKENDS:
        raise WeightUpdateGroupError(f"backend {backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (CUDA)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise WeightUpdateGroupError("backend 'nccl' needs CUDA; this process has no GPU, use 'gloo'")
    if not 0 <= rank < world_size:
        raise WeightUpdateGroupError(
            f"rank {rank} is outside the group of {world_size}; check rank_offset and world_size"
        )
    if not group_name:
        raise WeightUpdateGroupError("group_name is empty; name the group (e.g. 'weight_update_group')")
    timeout = timedelta(seconds=timeout_s)
    try:
        store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                  timeout=timeout))
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
        # the keyword of the backend options was renamed across torch releases
        options = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters \
            else "pg_options"
        group, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout, **{options: None}
        )
    except (RuntimeError, ValueError, OSError) as e:
        raise WeightUpdateGroupError(
            f"joining weight update group {group_name!r} at {master_address}:{master_port} as rank {rank} of "
            f"{world_size} failed: {e}"
        ) from e
    # collectives map group ranks through this table; ranks of this group are its own
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weight_update_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)
