"""The one owner of the rule "routing rows move with their KV": every copy of a block's KV between
tiers goes through BlockCopier, which moves the block's R3 rows and provenance tags in the same call.

    swap_out   GPU block -> CPU block      KV (KVTiers)  +  rows, tags  routing_host -> routing_swap
    swap_in    CPU block -> GPU block      KV (KVTiers)  +  rows, tags  routing_swap -> routing_host
    read       GPU block -> BlockData      KV bytes      +  rows, tags  (to be encoded into a blob)
    write      BlockData -> GPU block      KV bytes      +  rows, under a tag the engine chose

Callers: the CacheTransferManager's four task kinds (cache_transfer_manager.py: SWAP2CPU, SWAP2GPU,
GPU2STORAGE, STORAGE2GPU), and nothing else touches KVTiers or the routing buffers there. A
prefill/decode transfer is the one path around it: the prefill server's transfer engine writes a
stored blob's KV slices and rows into the decode engine's blocks in one batch, and the CTM stamps the
tags (pd_receive.py), so rows still arrive with their KV. With R3 off the routing buffers are None and
only KV moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdeploy_r3.cache_manager.kv_tiers import KVTiers
from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer
from fastdeploy_r3.cache_manager.slots import block_slots


@dataclass
class BlockData:
    """One GPU block off the device: its KV on every rank and, with R3 on, its rows and their tags."""

    kv_parts: list[np.ndarray]  # [rank]: [num_layers, 2, block_bytes] (bytes)
    rows: np.ndarray | None  # [block_size, L, K]
    tags: np.ndarray | None  # [block_size] int64: who wrote each row


class BlockCopier:
    def __init__(self, kv: KVTiers, block_size: int, routing_host: RoutingBuffer | None,
                 routing_swap: RoutingBuffer | None) -> None:  # fmt: skip
        self.kv = kv
        self.block_size = block_size
        self.routing_host = routing_host  # rows of the GPU tier, addressed by GPU slot
        self.routing_swap = routing_swap  # rows of the CPU tier, addressed by CPU slot

    def swap_out(self, gpu_ids: list[int], cpu_ids: list[int]) -> int:
        """GPU blocks -> CPU blocks (pairwise), KV and rows; returns bytes moved."""
        nbytes = self.kv.swap_to_cpu(gpu_ids, cpu_ids)
        return nbytes + self._copy_rows(gpu_ids, cpu_ids, self.routing_host, self.routing_swap)

    def swap_in(self, cpu_ids: list[int], gpu_ids: list[int]) -> int:
        """CPU blocks -> GPU blocks (pairwise), KV and rows; the rows keep the tags they left with."""
        nbytes = self.kv.swap_to_gpu(cpu_ids, gpu_ids)
        return nbytes + self._copy_rows(cpu_ids, gpu_ids, self.routing_swap, self.routing_host)

    def read(self, gpu_ids: list[int]) -> list[BlockData]:
        """The KV, rows and tags of GPU blocks, as they are now (rows copied, not views)."""
        host_kv = self.kv.blocks_to_host(gpu_ids)  # [i][rank]
        out = []
        for block_id, parts in zip(gpu_ids, host_kv, strict=True):
            rows = tags = None
            if self.routing_host is not None:
                slots = self._slots(block_id)
                rows, tags = self.routing_host.rows[slots].copy(), self.routing_host.tags[slots].copy()
            out.append(BlockData(parts, rows, tags))
        return out

    def write(self, gpu_ids: list[int], blocks: list[BlockData], tags: list[int]) -> None:
        """BlockData into GPU blocks: the KV, and the rows stamped with tags[i] (the engine's fresh tag:
        rows from elsewhere are data only under a tag this engine handed out)."""
        if self.routing_host is not None:
            for block_id, data in zip(gpu_ids, blocks, strict=True):  # all checked before any is written
                if data.rows is None:
                    raise ValueError(f"block for GPU block {block_id} carries no routing rows but R3 is on")
            for block_id, data, tag in zip(gpu_ids, blocks, tags, strict=True):
                slots = self._slots(block_id)
                self.routing_host.rows[slots] = data.rows  # [block_size, L, K]
                self.routing_host.tags[slots] = tag
        self.kv.host_to_blocks(gpu_ids, [d.kv_parts for d in blocks])

    def close(self) -> None:
        for buf in (self.routing_swap, self.routing_host):
            if buf is not None:
                buf.close()
        self.routing_swap = self.routing_host = None
        self.kv.close()

    def _slots(self, block_id: int) -> slice:
        return slice(block_id * self.block_size, (block_id + 1) * self.block_size)

    def _copy_rows(self, src_ids: list[int], dst_ids: list[int], src: RoutingBuffer | None,
                   dst: RoutingBuffer | None) -> int:  # fmt: skip
        if src is None or dst is None:
            return 0
        s_slots, d_slots = block_slots(src_ids, self.block_size), block_slots(dst_ids, self.block_size)
        dst.rows[d_slots] = src.rows[s_slots]  # [n * block_size, L, K]
        dst.tags[d_slots] = src.tags[s_slots]
        return len(s_slots) * (src.rows[0].nbytes + 8)
