"""Worker rank 0's R3 write on CUDA (DESIGN.md §5.2): the SHM routing_host_buffer is registered with
CUDA as mapped, portable host memory, whose device address equals its host address, and one Triton
kernel scatters the step's rows and tags straight into it at slot_mapping. No D2H copy and no CPU
scatter sit on the step; the stream is synchronised before the step's tokens leave the worker.
(Debug mode keeps the checked CPU path, RoutingCacheManager.write_step.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer
from fastdeploy_r3.model_executor.ops.routing_capture_kernel import scatter_rows_to_host

_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2
_TORCH_DTYPE = {np.dtype(np.uint8): torch.uint8, np.dtype(np.uint16): torch.uint16, np.dtype(np.int32): torch.int32}


@dataclass(frozen=True)
class _HostPointer:
    """What a Triton launch takes as a pointer argument."""

    address: int
    dtype: torch.dtype

    def data_ptr(self) -> int:
        return self.address


class MappedRoutingWriter:
    def __init__(self, buffer: RoutingBuffer) -> None:
        self._cudart = torch.cuda.cudart()
        self._base = buffer.rows.ctypes.data  # the segment starts with the rows, tags follow
        err = self._cudart.cudaHostRegister(
            self._base, buffer.spec.nbytes, _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
        )
        if err != self._cudart.cudaError.success:
            raise RuntimeError(
                f"cudaHostRegister of routing_host_buffer ({buffer.spec.nbytes} bytes) failed with {err}; "
                "check the locked-memory limit (ulimit -l) or run with R3 debug_mode to use the CPU path"
            )
        self.rows = _HostPointer(self._base, _TORCH_DTYPE[buffer.rows.dtype])
        self.tags = _HostPointer(buffer.tags.ctypes.data, torch.int64)

    def write(
        self, step_rows: torch.Tensor, slot_mapping: torch.Tensor, tags: torch.Tensor, synchronize: bool = True
    ) -> None:
        """step_rows [T, L, K] int32 on the device, slot_mapping [T], tags [T] int64; done on return.

        synchronize=False leaves the wait to the caller, who must synchronise the stream (the step's
        sampled-token fetch does) before the step's tokens are published.
        """
        scatter_rows_to_host(step_rows, slot_mapping, tags, self.rows, self.tags)
        if synchronize:
            torch.cuda.current_stream(step_rows.device).synchronize()

    def close(self) -> None:
        if self._base:
            self._cudart.cudaHostUnregister(self._base)
            self._base = 0
