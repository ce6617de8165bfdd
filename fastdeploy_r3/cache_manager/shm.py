"""Named POSIX shared-memory segments shared by the engine, workers and the CacheTransferManager.

Every name carries the engine's unique suffix (`fdr3_<suffix>_<what>`), so two engines never meet,
and a stale segment left by a crashed engine with the same name is removed before creating.
"""

from __future__ import annotations

import os
import secrets
from multiprocessing import resource_tracker, shared_memory
from typing import TYPE_CHECKING

import numpy as np

from fastdeploy_r3.lifecycle import pid_alive

if TYPE_CHECKING:
    import torch

SHM_PREFIX = "fdr3_"


class SharedMemoryError(RuntimeError):
    """/dev/shm cannot hold what the engine needs."""


def new_engine_suffix() -> str:
    return f"{os.getpid()}_{secrets.token_hex(4)}"


def shm_name(suffix: str, what: str) -> str:
    return f"{SHM_PREFIX}{suffix}_{what}"


def shm_free_bytes() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 1 << 62
    return st.f_bavail * st.f_frsize


def _untrack(shm: shared_memory.SharedMemory) -> None:
    # The engine owns the lifetime of every segment; Python's resource tracker would otherwise unlink
    # segments when the first attaching process exits, and warn about "leaks" it does not own.
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:
        pass


class ShmSegment:
    """One named segment; `create` owns it (unlink at close), `attach` only maps it."""

    def __init__(self, shm: shared_memory.SharedMemory, owner: bool) -> None:
        self._shm = shm
        self.owner = owner
        self.name = shm.name
        self.size = shm.size

    @classmethod
    def create(cls, name: str, nbytes: int) -> ShmSegment:
        nbytes = max(int(nbytes), 1)
        free = shm_free_bytes()
        if nbytes > free:
            raise SharedMemoryError(
                f"/dev/shm has {free / 2**20:.1f} MiB free but {name} needs {nbytes / 2**20:.1f} MiB; "
                "enlarge /dev/shm (e.g. docker --shm-size) or lower num_gpu_blocks / swap_space"
            )
        unlink_quietly(name)
        shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        _untrack(shm)
        try:
            # tmpfs hands out pages only when they are touched, so an untouched segment does not count
            # against /dev/shm and the check above passes for segments that together cannot fit; the
            # first touch past the limit is then a SIGBUS. Reserving every page now turns that into a
            # clear error at creation, and makes the next segment's check see this one.
            os.posix_fallocate(shm._fd, 0, nbytes)  # type: ignore[attr-defined]
        except OSError as e:
            shm.close()
            unlink_quietly(name)
            raise SharedMemoryError(
                f"/dev/shm cannot reserve {nbytes / 2**20:.1f} MiB for {name} ({e.strerror}); enlarge /dev/shm "
                "(e.g. docker --shm-size) or lower num_gpu_blocks / swap_space"
            ) from e
        return cls(shm, owner=True)

    @classmethod
    def attach(cls, name: str) -> ShmSegment:
        shm = shared_memory.SharedMemory(name=name, create=False)
        _untrack(shm)
        return cls(shm, owner=False)

    @property
    def buf(self) -> memoryview:
        return self._shm.buf

    def numpy(self, shape: tuple[int, ...], dtype: np.dtype | type, offset: int = 0) -> np.ndarray:
        return np.ndarray(shape, dtype=dtype, buffer=self._shm.buf, offset=offset)

    def torch(self, shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        import torch  # the workers' view; the engine and the CTM read segments through numpy

        numel = int(np.prod(shape)) if shape else 1
        t = torch.frombuffer(self._shm.buf, dtype=dtype, count=numel, offset=offset)
        return t.view(shape)

    def close(self) -> None:
        try:
            self._shm.close()
        except BufferError:
            # numpy/torch views still alive in this process; the mapping goes with the process.
            pass
        if self.owner:
            unlink_quietly(self.name)


def unlink_quietly(name: str) -> None:
    path = os.path.join("/dev/shm", name.lstrip("/"))
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        pass


def list_segments(suffix: str | None = None) -> list[str]:
    """Segments of this project in /dev/shm (all engines, or one engine's by suffix)."""
    prefix = SHM_PREFIX if suffix is None else f"{SHM_PREFIX}{suffix}_"
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:
        return []


def remove_stale_segments() -> list[str]:
    """Unlink segments of engines whose process is gone (the pid is the first part of the suffix)."""
    removed = []
    for name in list_segments():
        pid_part = name[len(SHM_PREFIX) :].split("_", 1)[0]
        if not pid_part.isdigit() or pid_alive(int(pid_part)):
            continue
        unlink_quietly(name)
        removed.append(name)
    return removed


def unlink_all(suffix: str) -> None:
    for name in list_segments(suffix):
        unlink_quietly(name)
