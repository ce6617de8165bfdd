"""Worker rank 0's R3 write: a step's rows and tags into the SHM routing_host_buffer
at the step's slot_mapping, before the step's tokens leave the worker.

    RoutingWriter          rows_of(capture, T), then write(rows, slot_mapping, tags, positions)
      CpuRoutingWriter     numpy rows in the routing dtype, every input checked (debug mode too)
      MappedRoutingWriter  CUDA: the SHM is registered as mapped, portable host memory, whose device
                           address equals its host address; one Triton kernel scatters the device
                           rows straight into it. No D2H copy and no CPU scatter on the step.

Contract of write: only real tokens (padded ones dropped by the caller); once write returns (and, with
synchronize=False, once the caller has synchronised the stream) the rows and tags are in the host
buffer, visible to the engine's gather.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import torch

from fastdeploy_r3.cache_manager.routing_buffer import NO_TAG, RoutingBuffer
from fastdeploy_r3.model_executor.ops.routing_capture_kernel import scatter_rows_to_host
from fastdeploy_r3.r3.errors import RoutingReplayError
from fastdeploy_r3.worker.routing_capture import RoutingCapture


class RoutingWriter(abc.ABC):
    @abc.abstractmethod
    def rows_of(self, capture: RoutingCapture, num_tokens: int) -> np.ndarray | torch.Tensor:
        """The step's rows [T, L, K] in the form write() takes."""

    @abc.abstractmethod
    def write(
        self,
        rows: np.ndarray | torch.Tensor,
        slot_mapping: torch.Tensor,
        tags: torch.Tensor,
        positions: torch.Tensor | None = None,
        synchronize: bool = True,
    ) -> None:
        """rows [T, L, K], slot_mapping [T], tags [T] int64 (and positions [T] for debug checks).

        synchronize=False (device writers) leaves the wait to the caller, who must synchronise the
        stream (the step's one sampled-token fetch does) before the step's tokens are published."""

    def close(self) -> None:  # noqa: B027 - optional: the CPU writer holds nothing to release
        """Release what the writer registered; the host buffer itself belongs to its owner."""


class CpuRoutingWriter(RoutingWriter):
    """Checked numpy writes. In debug mode positions are required and every row must equal its position
    mod sentinel, so an addressing bug in the worker shows up here rather than at gather."""

    def __init__(self, buffer: RoutingBuffer, debug_mode: bool = False) -> None:
        self.buffer = buffer
        self.debug_mode = debug_mode

    def rows_of(self, capture: RoutingCapture, num_tokens: int) -> np.ndarray:
        return capture.step_rows(num_tokens)  # [T, L, K] routing dtype, ids checked; debug rows in debug mode

    def write(
        self,
        rows: np.ndarray | torch.Tensor,
        slot_mapping: torch.Tensor | np.ndarray,
        tags: torch.Tensor | np.ndarray,
        positions: torch.Tensor | np.ndarray | None = None,
        synchronize: bool = True,  # numpy writes are done on return either way
    ) -> None:
        rows, slots, tags_np = _numpy(rows), _numpy(slot_mapping).astype(np.int64), _numpy(tags).astype(np.int64)
        T = len(slots)
        L, K = self.buffer.rows.shape[1:]
        if rows.shape != (T, L, K) or tags_np.shape != (T,):
            raise RoutingReplayError(f"routing write: rows {rows.shape} / tags {tags_np.shape} do not match "
                                     f"[{T}, {L}, {K}] / [{T}] for {T} slots")
        if rows.dtype != self.buffer.rows.dtype:
            raise RoutingReplayError(
                f"routing write: rows are {rows.dtype}, the host buffer holds {self.buffer.rows.dtype}"
            )
        bad = np.nonzero((slots < 0) | (slots >= len(self.buffer.tags)))[0]
        if len(bad):
            t = int(bad[0])
            raise RoutingReplayError(f"routing write: token {t} of the step has slot {int(slots[t])}, outside "
                                     f"[0, {len(self.buffer.tags)}); drop padded tokens before writing")
        if (tags_np == NO_TAG).any():
            raise RoutingReplayError(
                f"routing write: tag {NO_TAG} means 'never written'; give every computed block a tag"
            )
        if self.debug_mode:
            self._check_debug_rows(rows, slots, positions)
        self.buffer.write(rows, slots, tags_np)

    def _check_debug_rows(self, rows: np.ndarray, slots: np.ndarray, positions: object) -> None:
        if positions is None:
            raise RoutingReplayError("routing write: debug mode needs the positions of the step's tokens")
        pos = _numpy(positions).astype(np.int64)  # [T]
        want = pos % self.buffer.sentinel  # [T]
        bad = np.nonzero((rows.astype(np.int64) != want[:, None, None]).any(axis=(1, 2)))[0]
        if len(bad):
            t = int(bad[0])
            raise RoutingReplayError(
                f"debug mode: token {t} of the step (position {int(pos[t])}, slot {int(slots[t])}) "
                f"carries ids {rows[t].reshape(-1)[:4].tolist()}... instead of {int(want[t])}"
            )


def _numpy(x: np.ndarray | torch.Tensor | object) -> np.ndarray:
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


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


class MappedRoutingWriter(RoutingWriter):
    """CUDA only, debug mode off (debug mode keeps the checked CpuRoutingWriter)."""

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

    def rows_of(self, capture: RoutingCapture, num_tokens: int) -> torch.Tensor:
        return capture.device_rows(num_tokens)  # [T, L, K] int32 on the device; narrowed by the kernel

    def write(
        self,
        rows: np.ndarray | torch.Tensor,
        slot_mapping: torch.Tensor,
        tags: torch.Tensor,
        positions: torch.Tensor | None = None,
        synchronize: bool = True,
    ) -> None:
        """rows [T, L, K] int32 on the device, slot_mapping [T], tags [T] int64; done on return unless
        synchronize=False (then done once the caller has synchronised the stream)."""
        assert isinstance(rows, torch.Tensor)
        scatter_rows_to_host(rows, slot_mapping, tags, self.rows, self.tags)
        if synchronize:
            torch.cuda.current_stream(rows.device).synchronize()

    def close(self) -> None:
        if self._base:
            self._cudart.cudaHostUnregister(self._base)
            self._base = 0


def make_routing_writer(buffer: RoutingBuffer, device: torch.device, debug_mode: bool) -> RoutingWriter:
    """The kernel path on CUDA; the checked CPU path on CPU and in debug mode."""
    if device.type == "cuda" and not debug_mode:
        return MappedRoutingWriter(buffer)
    return CpuRoutingWriter(buffer, debug_mode)
