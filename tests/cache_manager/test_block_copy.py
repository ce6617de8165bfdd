"""BlockCopier, the one place a block's R3 rows move with its KV: four GPU blocks of 2 slots, a 2-block
CPU tier, one rank whose KV is a plain array, and real SHM routing buffers (L = 2, K = 1)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from fastdeploy_r3.cache_manager.block_copy import BlockCopier, BlockData
from fastdeploy_r3.cache_manager.kv_tiers import KVTiers
from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer, RoutingBufferSpec
from fastdeploy_r3.cache_manager.shm import new_engine_suffix, shm_name, unlink_quietly

BS = 2


class ArrayKV(KVTiers):
    """One rank: gpu_kv / cpu_kv [num_layers=1, 2, num_blocks, block_bytes=3] numpy arrays."""

    def __init__(self, num_gpu: int, num_cpu: int) -> None:
        self.gpu_kv = [np.zeros((1, 2, num_gpu, 3), np.uint8)]
        self.cpu_kv = [np.zeros((1, 2, num_cpu, 3), np.uint8)]

    def _copy(self, src: np.ndarray, src_ids: list[int], dst: np.ndarray, dst_ids: list[int]) -> int:
        for s, d in zip(src_ids, dst_ids, strict=True):
            dst[:, :, d] = src[:, :, s]
        return len(src_ids) * 6

    def swap_to_cpu(self, gpu_ids: list[int], cpu_ids: list[int]) -> int:
        return self._copy(self.gpu_kv[0], gpu_ids, self.cpu_kv[0], cpu_ids)

    def swap_to_gpu(self, cpu_ids: list[int], gpu_ids: list[int]) -> int:
        return self._copy(self.cpu_kv[0], cpu_ids, self.gpu_kv[0], gpu_ids)

    def blocks_to_host(self, block_ids: list[int]) -> list[list[np.ndarray]]:
        return [[self.gpu_kv[0][:, :, b].copy()] for b in block_ids]

    def host_to_blocks(self, block_ids: list[int], parts: list[list[np.ndarray]]) -> None:
        for b, (part,) in zip(block_ids, parts, strict=True):
            self.gpu_kv[0][:, :, b] = part

    def close(self) -> None:
        pass


@pytest.fixture
def copier() -> Iterator[BlockCopier]:
    suffix = new_engine_suffix()
    host = RoutingBuffer.create(RoutingBufferSpec(shm_name(suffix, "routing_host"), 4 * BS, 2, 1, "uint8"))
    swap = RoutingBuffer.create(RoutingBufferSpec(shm_name(suffix, "routing_swap"), 2 * BS, 2, 1, "uint8"))
    kv = ArrayKV(4, 2)
    for b in range(4):  # GPU block b: KV bytes 10 + b, rows 20 + b, tag 100 + b
        kv.gpu_kv[0][:, :, b] = 10 + b
        host.rows[b * BS : (b + 1) * BS] = 20 + b
        host.tags[b * BS : (b + 1) * BS] = 100 + b
    yield BlockCopier(kv, BS, host, swap)
    for what in ("routing_host", "routing_swap"):
        unlink_quietly(shm_name(suffix, what))


def gpu_block(c: BlockCopier, b: int) -> tuple[int, int, list[int]]:
    """(KV byte, row value, tags) of GPU block b, each checked uniform over the block."""
    kv = c.kv.gpu_kv[0][:, :, b]
    rows, tags = c.routing_host.rows[b * BS : (b + 1) * BS], c.routing_host.tags[b * BS : (b + 1) * BS]
    assert (kv == kv.flat[0]).all() and (rows == rows.flat[0]).all()
    return int(kv.flat[0]), int(rows.flat[0]), tags.tolist()


def test_swapped_blocks_come_back_with_their_rows_and_tags(copier: BlockCopier) -> None:
    """GPU 3 -> CPU 0 and GPU 1 -> CPU 1; GPU 3 and 1 are rewritten; CPU 0 comes back into GPU 2 with
    block 3's KV, rows and tag."""
    copier.swap_out([3, 1], [0, 1])
    for b in (3, 1):
        copier.kv.gpu_kv[0][:, :, b] = 0
        copier.routing_host.rows[b * BS : (b + 1) * BS] = 0
    copier.swap_in([0], [2])
    assert gpu_block(copier, 2) == (13, 23, [103, 103])


def test_a_block_read_and_written_elsewhere_carries_its_rows_under_the_writers_tag(copier: BlockCopier) -> None:
    """Block 2 is read (as the storage tier's put or a prefill engine would) and written into block 0
    (a load, or a decode engine's reserved block): same KV and rows, tag 7, the tag the writer gave."""
    (data,) = copier.read([2])
    assert data.tags.tolist() == [102, 102]
    copier.write([0], [data], tags=[7])
    assert gpu_block(copier, 0) == (12, 22, [7, 7])
    with pytest.raises(ValueError, match="GPU block 1 carries no routing rows but R3 is on"):
        copier.write([3, 1], [data, BlockData(data.kv_parts, None, None)], tags=[8, 9])
    assert gpu_block(copier, 3) == (13, 23, [103, 103])  # nothing of a refused write lands, not even
    assert gpu_block(copier, 1) == (11, 21, [101, 101])  # its blocks that had rows
