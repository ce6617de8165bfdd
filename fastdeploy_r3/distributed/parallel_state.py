"""Tensor-parallel process group of the workers: one rank per worker process, one group per engine.

    engine ── free_init_method() ──► "tcp://127.0.0.1:PORT" ──► worker r: init_distributed(r, N, ...)

Models do not read this state: layers are built with their (tp_rank, tp_size) scalars; this module
only starts and stops the group and sums partial outputs across it.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

# a rank stuck in a collective (its peer died mid-step) fails after this instead of hanging for 30 min
_COLLECTIVE_TIMEOUT = timedelta(seconds=300)


def free_init_method() -> str:
    """A TCP rendezvous on a port free right now (the OS picks it; rank 0 binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


# FDR3_RANKS_SHARE_GPU=1: rank r runs on GPU r mod (visible GPUs), so that two ranks can share one GPU for
# a smoke test of a multi-rank layout on a one-GPU machine. NCCL refuses two ranks on one device, so the
# group is gloo then (it takes CUDA tensors for all_reduce, all_gather, all_to_all and broadcast through
# host copies): slow, graph-unsafe (run such an engine with enforce_eager), never a deployment.
SHARE_GPU_ENV = "FDR3_RANKS_SHARE_GPU"


def ranks_share_gpu() -> bool:
    return os.environ.get(SHARE_GPU_ENV, "") == "1"


def cuda_index(rank: int) -> int:
    """The CUDA device of TP rank `rank`: its own GPU, or GPU rank mod N when ranks share GPUs."""
    if ranks_share_gpu() and torch.cuda.is_available():
        return rank % torch.cuda.device_count()
    return rank


def init_distributed(rank: int, world_size: int, init_method: str, device_type: str) -> None:
    """Join the group: NCCL on CUDA (after selecting this rank's GPU), gloo on CPU (and on GPUs shared
    by ranks, FDR3_RANKS_SHARE_GPU above).

    A single rank needs no group: every all_reduce is then a no-op and TP=1 runs exactly as without TP.
    """
    if world_size == 1:
        return
    backend = "nccl" if device_type == "cuda" and not ranks_share_gpu() else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(cuda_index(rank))
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=_COLLECTIVE_TIMEOUT
    )


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_tp_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the TP ranks in place and return it; x itself when there is one rank.

    Every rank gets the same bits (a two-rank sum is commutative; larger rings reduce each chunk once
    and broadcast it), which keeps the replicated router choosing the same experts on every rank.
    """
    if get_tp_world_size() == 1:
        return x
    dist.all_reduce(x)
    return x
