"""Capacity and age limits of a directory store: the file KV storage tier and the local R3 store.

    budget.admit(nbytes)    before a write: entries older than ttl_s go, then the least recently
                            used ones, until the new bytes fit under the capacity
    budget.expired(path)    on a read: an entry older than ttl_s is treated as missing
    budget.touch(path)      on a read hit: the entry becomes the most recently used

The LRU clock is each entry's mtime (a write sets it, a read hit touches it), so engines sharing a
directory share one order without a shared index. An entry is a file (KV tier: one block) or, with
`whole_dirs`, a top-level file or directory with everything in it (local R3 store: one rollout,
fused or per layer), removed whole so that no reader finds part of a rollout. The byte count is kept
incrementally and measured again every `rescan_every` writes and whenever it reaches the capacity
(other writers add bytes too); an eviction goes down to 90 % of the capacity, so sweeps are rare.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

_LOW_WATERMARK = 0.9


@dataclass
class BudgetCounters:
    evicted: int = 0  # entries removed to make room (least recently used first)
    evicted_bytes: int = 0
    expired: int = 0  # entries removed for their age


class DiskBudget:
    def __init__(
        self,
        root: str,
        capacity_bytes: int | None = None,
        ttl_s: float | None = None,
        whole_dirs: bool = False,
        clock: Callable[[], float] = time.time,
        rescan_every: int = 256,
    ) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self.whole_dirs = whole_dirs
        self._clock = clock
        self._rescan_every = rescan_every
        self._used: int | None = None  # None: not measured yet
        self._writes = 0
        self.counters = BudgetCounters()

    @property
    def limited(self) -> bool:
        return self.capacity_bytes is not None or self.ttl_s is not None

    def admit(self, nbytes: int) -> None:
        """Make room for a write of `nbytes` (call it before writing)."""
        if not self.limited:
            return
        self._writes += 1
        over = self.capacity_bytes is not None and (self._used or 0) + nbytes > self.capacity_bytes
        if self._used is None or over or self._writes % self._rescan_every == 0:
            self._sweep(nbytes)
        self._used = (self._used or 0) + nbytes

    def expired(self, path: str) -> bool:
        if self.ttl_s is None:
            return False
        try:
            return self._clock() - os.stat(path).st_mtime > self.ttl_s
        except OSError:
            return False

    def touch(self, path: str) -> None:
        try:
            os.utime(path)
        except OSError:
            pass  # removed meanwhile: nothing to keep

    def _entries(self) -> list[tuple[str, int, float]]:
        """(path, bytes, mtime) of every entry; temp files and staging directories of writers are not entries."""
        out = []
        if self.whole_dirs:
            with os.scandir(self.root) as it:
                for e in it:
                    if e.name.startswith(".") or ".tmp." in e.name:
                        continue
                    try:
                        if e.is_dir(follow_symlinks=False):
                            size, mtime = _tree_size_mtime(e.path)
                        else:
                            st = e.stat(follow_symlinks=False)
                            size, mtime = st.st_size, st.st_mtime
                    except OSError:
                        continue  # removed meanwhile
                    out.append((e.path, size, mtime))
            return out
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                if ".tmp." in name:
                    continue
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                out.append((path, st.st_size, st.st_mtime))
        return out

    def _sweep(self, incoming: int) -> None:
        now = self._clock()
        live = []
        for path, size, mtime in self._entries():
            if self.ttl_s is not None and now - mtime > self.ttl_s:
                _remove(path)
                self.counters.expired += 1
            else:
                live.append((mtime, path, size))
        used = sum(size for _, _, size in live)
        cap = self.capacity_bytes
        if cap is not None and used + incoming > cap:
            for _, path, size in sorted(live):
                if used + incoming <= cap * _LOW_WATERMARK:
                    break
                _remove(path)
                used -= size
                self.counters.evicted += 1
                self.counters.evicted_bytes += size
        self._used = used


def _tree_size_mtime(path: str) -> tuple[int, float]:
    size, mtime = 0, os.stat(path).st_mtime
    for dirpath, _, files in os.walk(path):
        for name in files:
            st = os.stat(os.path.join(dirpath, name))
            size += st.st_size
            mtime = max(mtime, st.st_mtime)
    return size, mtime


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass
