"""The KV half of the CacheTransferManager's copies, one class per device behind one interface.

    KVTiers             swap_to_cpu / swap_to_gpu     GPU tier <-> CPU tier, block ids paired
                        blocks_to_host / host_to_blocks  GPU tier <-> bytes, for the storage tier
      CpuKVTiers        the "GPU" tier is each worker's SHM KV cache; the CPU tier SHM this CTM owns;
                        byte copies through numpy views [num_layers, 2, num_blocks, block_bytes]
      CudaKVTiers       the GPU tier is each worker's device tensor, mapped through its CUDA IPC handle;
                        the CPU tier pinned host memory laid out block-major
                        [num_cpu_blocks, num_layers, 2, block_bytes], so each block (or run of
                        consecutive blocks) is one contiguous DMA; synchronised before returning

Routing rows are not here: they live in SHM on every device and the CTM moves them itself. Every
copy is a byte copy, so bfloat16 needs no numpy support. CudaKVTiers is today's CUDA path moved as it
was; it runs only on a GPU machine (tests/gpu), not in the CPU suite.
"""

from __future__ import annotations

import abc

import numpy as np
import torch

from fastdeploy_r3.cache_manager.shm import ShmSegment
from fastdeploy_r3.cache_manager.transfer import KVCacheSpec, cpu_kv_name


class KVTiers(abc.ABC):
    """Per TP rank: gpu_kv[rank] [num_layers, 2, num_gpu_blocks, block_bytes] and a CPU tier of
    num_cpu_blocks (0: none). Every method returns only once the bytes are in place."""

    gpu_kv: list
    cpu_kv: list

    @property
    def num_gpu_blocks(self) -> int:
        return self.gpu_kv[0].shape[2]

    @abc.abstractmethod
    def swap_to_cpu(self, gpu_ids: list[int], cpu_ids: list[int]) -> int:
        """KV of GPU blocks gpu_ids into CPU blocks cpu_ids (pairwise); returns bytes moved."""

    @abc.abstractmethod
    def swap_to_gpu(self, cpu_ids: list[int], gpu_ids: list[int]) -> int:
        """KV of CPU blocks cpu_ids into GPU blocks gpu_ids (pairwise); returns bytes moved."""

    @abc.abstractmethod
    def blocks_to_host(self, block_ids: list[int]) -> list[list[np.ndarray]]:
        """[i][rank]: the KV bytes of GPU block block_ids[i] on rank, [num_layers, 2, block_bytes]."""

    @abc.abstractmethod
    def host_to_blocks(self, block_ids: list[int], parts: list[list[np.ndarray]]) -> None:
        """parts[i][rank] (the KV bytes of one block) into GPU block block_ids[i] of each rank."""

    @abc.abstractmethod
    def close(self) -> None: ...


class CpuKVTiers(KVTiers):
    def __init__(self, specs: list[KVCacheSpec], num_cpu_blocks: int, kv_cpu_name: str | None) -> None:
        self._attached: list[ShmSegment] = []
        self._owned: list[ShmSegment] = []
        self.gpu_kv: list[np.ndarray] = []
        self.cpu_kv: list[np.ndarray] = []
        try:
            for spec in specs:
                seg = ShmSegment.attach(spec.name)
                self._attached.append(seg)
                num_layers, _, num_blocks = spec.shape[:3]
                self.gpu_kv.append(seg.numpy((num_layers, 2, num_blocks, spec.layer_block_nbytes), np.uint8))
            for rank, kv in enumerate(self.gpu_kv if num_cpu_blocks else []):
                assert kv_cpu_name is not None
                num_layers, _, _, block_bytes = kv.shape
                seg = ShmSegment.create(cpu_kv_name(kv_cpu_name, rank), num_layers * 2 * num_cpu_blocks * block_bytes)
                self._owned.append(seg)
                self.cpu_kv.append(seg.numpy((num_layers, 2, num_cpu_blocks, block_bytes), np.uint8))
        except BaseException:
            self.close()
            raise

    def _copy(self, src_kv: list[np.ndarray], src_ids: list[int], dst_kv: list[np.ndarray], dst_ids: list[int]) -> int:
        nbytes = 0
        for src, dst in zip(src_kv, dst_kv, strict=True):
            for s, d in zip(src_ids, dst_ids, strict=True):
                dst[:, :, d] = src[:, :, s]  # [num_layers, 2, block_bytes]
            nbytes += len(src_ids) * src.shape[0] * 2 * src.shape[3]
        return nbytes

    def swap_to_cpu(self, gpu_ids: list[int], cpu_ids: list[int]) -> int:
        return self._copy(self.gpu_kv, gpu_ids, self.cpu_kv, cpu_ids)

    def swap_to_gpu(self, cpu_ids: list[int], gpu_ids: list[int]) -> int:
        return self._copy(self.cpu_kv, cpu_ids, self.gpu_kv, gpu_ids)

    def blocks_to_host(self, block_ids: list[int]) -> list[list[np.ndarray]]:
        return [[kv[:, :, b] for kv in self.gpu_kv] for b in block_ids]  # views: encode_block copies them

    def host_to_blocks(self, block_ids: list[int], parts: list[list[np.ndarray]]) -> None:
        for block_id, kv_parts in zip(block_ids, parts, strict=True):
            for kv, part in zip(self.gpu_kv, kv_parts, strict=True):
                kv[:, :, block_id] = part.reshape(kv.shape[0], 2, kv.shape[3])

    def close(self) -> None:
        self.gpu_kv, self.cpu_kv = [], []
        for seg in self._owned + self._attached:
            seg.close()
        self._owned, self._attached = [], []


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


def make_kv_tiers(specs: list[KVCacheSpec], num_cpu_blocks: int, kv_cpu_name: str | None) -> KVTiers:
    """The copier for the device the workers' KV caches live on (all ranks on one device kind)."""
    if specs[0].device == "cuda":
        return CudaKVTiers(specs, num_cpu_blocks)
    return CpuKVTiers(specs, num_cpu_blocks, kv_cpu_name)
