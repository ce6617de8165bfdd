"""Shared-memory R3 row buffers, addressed by KV slot.

    routing_host_buffer  [num_gpu_blocks * block_size, L, K]  engine creates; worker rank 0 writes,
                                                               TokenProcessor gathers, CTM swaps
    routing_swap_buffer  [num_cpu_blocks * block_size, L, K]  CTM creates (CPU tier)

Each row has a provenance tag (int64): the tag of the KV block whose computation wrote it. Tag 0
means "never written". A row is data only when its tag equals the tag the engine recorded for the
block that holds it (RoutingCacheManager checks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdeploy_r3.cache_manager.shm import ShmSegment
from fastdeploy_r3.r3.errors import sentinel_of

NO_TAG = 0


@dataclass(frozen=True)
class RoutingBufferSpec:
    """What crosses a process so that another one can attach."""

    name: str
    num_slots: int
    num_layers: int
    top_k: int
    dtype: str  # numpy dtype name

    @property
    def rows_nbytes(self) -> int:
        return self.num_slots * self.num_layers * self.top_k * np.dtype(self.dtype).itemsize

    @property
    def tags_offset(self) -> int:
        return (self.rows_nbytes + 63) // 64 * 64

    @property
    def nbytes(self) -> int:
        return self.tags_offset + self.num_slots * 8


class RoutingBuffer:
    def __init__(self, spec: RoutingBufferSpec, segment: ShmSegment) -> None:
        self.spec = spec
        self._segment = segment
        self.rows = segment.numpy((spec.num_slots, spec.num_layers, spec.top_k), np.dtype(spec.dtype))
        self.tags = segment.numpy((spec.num_slots,), np.int64, offset=spec.tags_offset)

    @classmethod
    def create(cls, spec: RoutingBufferSpec) -> RoutingBuffer:
        buf = cls(spec, ShmSegment.create(spec.name, spec.nbytes))
        buf.rows.fill(sentinel_of(buf.rows.dtype))  # "no route"
        buf.tags.fill(NO_TAG)
        return buf

    @classmethod
    def attach(cls, spec: RoutingBufferSpec) -> RoutingBuffer:
        return cls(spec, ShmSegment.attach(spec.name))

    @property
    def sentinel(self) -> int:
        return sentinel_of(self.rows.dtype)

    def write(self, rows: np.ndarray, slot_mapping: np.ndarray, tags: np.ndarray) -> None:
        """rows [T, L, K] and tags [T] go to slots slot_mapping [T] (the argument order of every R3 write)."""
        self.rows[slot_mapping] = rows
        self.tags[slot_mapping] = tags

    def read(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Copies of rows [T, L, K] and tags [T] at slots [T]."""
        return self.rows[slots], self.tags[slots]

    def close(self) -> None:
        del self.rows, self.tags
        self._segment.close()

