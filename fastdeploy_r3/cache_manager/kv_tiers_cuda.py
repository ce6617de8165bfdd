"""CudaKVTiers (kv_tiers.py's interface): the GPU tier is each worker's device tensor, mapped through its
CUDA IPC handle; the CPU tier pinned host memory laid out block-major [num_cpu_blocks, num_layers, 2,
block_bytes], so each block (or run of consecutive blocks) is one contiguous DMA; every copy is
synchronised before it returns. Kept apart so that the CPU path imports no torch."""

from __future__ import annotations

import numpy as np
import torch

from fastdeploy_r3.cache_manager.kv_tiers import KVTiers
from fastdeploy_r3.cache_manager.transfer import KVCacheSpec


def _attach_cuda_kv(spec: KVCacheSpec) -> torch.Tensor:
    """The worker's CUDA KV cache mapped into this process, as bytes [num_layers, 2, num_blocks, block_bytes]."""
    if spec.cuda_ipc is None:
        raise ValueError(
            f"KV spec {spec.name} is on cuda but carries no cuda_ipc handle; the worker must set "
            "KVCacheSpec.cuda_ipc = torch.multiprocessing.reductions.reduce_tensor(kv_cache)"
        )
    rebuild, args = spec.cuda_ipc
    kv = rebuild(*args)
    if tuple(kv.shape) != tuple(spec.shape) or not kv.is_contiguous():
        raise ValueError(f"CUDA IPC tensor {tuple(kv.shape)} does not match the contiguous KV spec {spec.shape}")
    num_layers, _, num_blocks = spec.shape[:3]
    return kv.view(torch.uint8).view(num_layers, 2, num_blocks, spec.layer_block_nbytes)


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in ids, first id, length) of each run of consecutive ids: [4, 5, 9] -> [(0, 4, 2), (2, 9, 1)]."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if runs and b == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, b, 1))
    return runs


class CudaKVTiers(KVTiers):
    def __init__(self, specs: list[KVCacheSpec], num_cpu_blocks: int) -> None:
        self.gpu_kv: list[torch.Tensor] = [_attach_cuda_kv(spec) for spec in specs]
        self.cpu_kv: list[torch.Tensor] = []
        for gpu in self.gpu_kv if num_cpu_blocks else []:
            num_layers, _, _, block_bytes = gpu.shape
            self.cpu_kv.append(torch.empty((num_cpu_blocks, num_layers, 2, block_bytes),
                                           dtype=torch.uint8, pin_memory=True))  # fmt: skip

    def swap_to_cpu(self, gpu_ids: list[int], cpu_ids: list[int]) -> int:
        """Gather the blocks on the device into block-major order, then one async D2H copy per run of
        consecutive CPU ids."""
        nbytes = 0
        for gpu, cpu in zip(self.gpu_kv, self.cpu_kv, strict=True):
            idx = torch.tensor(gpu_ids, dtype=torch.int64, device=gpu.device)
            staged = gpu.index_select(2, idx).permute(2, 0, 1, 3).contiguous()  # [n, num_layers, 2, block_bytes]
            for pos, first, length in _runs(cpu_ids):
                cpu[first : first + length].copy_(staged[pos : pos + length], non_blocking=True)
            torch.cuda.synchronize(gpu.device)  # an ack only when the data is in place; `staged` lives until here
            nbytes += staged.numel()
        return nbytes

    def swap_to_gpu(self, cpu_ids: list[int], gpu_ids: list[int]) -> int:
        """One async H2D copy per run of consecutive CPU ids into a device staging buffer, then a scatter
        into the KV cache."""
        nbytes = 0
        for gpu, cpu in zip(self.gpu_kv, self.cpu_kv, strict=True):
            staged = torch.empty((len(cpu_ids), *cpu.shape[1:]), dtype=torch.uint8, device=gpu.device)  # [n, nl, 2, bb]
            for pos, first, length in _runs(cpu_ids):
                staged[pos : pos + length].copy_(cpu[first : first + length], non_blocking=True)
            idx = torch.tensor(gpu_ids, dtype=torch.int64, device=gpu.device)
            gpu.index_copy_(2, idx, staged.permute(1, 2, 0, 3))
            torch.cuda.synchronize(gpu.device)
            nbytes += staged.numel()
        return nbytes

    def blocks_to_host(self, block_ids: list[int]) -> list[list[np.ndarray]]:
        per_rank = []
        for gpu in self.gpu_kv:
            idx = torch.tensor(block_ids, dtype=torch.int64, device=gpu.device)
            per_rank.append(gpu.index_select(2, idx).permute(2, 0, 1, 3).contiguous().cpu().numpy())  # [n, nl, 2, bb]
        return [[host[i] for host in per_rank] for i in range(len(block_ids))]

    def host_to_blocks(self, block_ids: list[int], parts: list[list[np.ndarray]]) -> None:
        if not block_ids:
            return
        for rank, gpu in enumerate(self.gpu_kv):
            host = torch.from_numpy(np.stack([p[rank].reshape(gpu.shape[0], 2, gpu.shape[3]) for p in parts]))
            staged = host.pin_memory().to(gpu.device, non_blocking=True)  # [n, num_layers, 2, block_bytes]
            idx = torch.tensor(block_ids, dtype=torch.int64, device=gpu.device)
            gpu.index_copy_(2, idx, staged.permute(1, 2, 0, 3))
            torch.cuda.synchronize(gpu.device)

    def close(self) -> None:
        self.gpu_kv, self.cpu_kv = [], []
