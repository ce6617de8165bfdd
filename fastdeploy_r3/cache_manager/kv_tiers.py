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
copy is a byte copy, so bfloat16 needs no numpy support. CudaKVTiers lives in kv_tiers_cuda.py, the
only part that needs torch: a CPU engine's CTM never imports it (a torch import is ~3 s of CPU per
process start). It runs only on a GPU machine (tests/gpu), not in the CPU suite.
"""

from __future__ import annotations

import abc

import numpy as np

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
