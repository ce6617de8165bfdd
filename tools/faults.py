"""Faults for the fault-matrix test and tools/soak.py, and the check of what a dead server left behind.

    server tree        api server ─► fdr3-engine ─► fdr3-worker<r>, fdr3-ctm   (found by /proc comm)
    process faults     SIGKILL, or SIGSTOP for a while and SIGCONT, of one role
    store faults       SIGSTOP of redis-server; the KV storage directory full, read-only or corrupt
    leftovers          processes of the tree still alive, /dev/shm segments named after its engine,
                       the IPC directory named after its API server

The storage directory faults need a filesystem of their own: `in_private_tmpfs` wraps the server's
command so it runs in a private mount namespace with a small tmpfs on the directory (root, or
unprivileged user namespaces), and `StorageFaults` reaches into that namespace with nsenter. Nothing
outside the server's own namespace is mounted or touched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

SHM_DIR = "/dev/shm"
ROLE_COMMS = {"engine": "fdr3-engine", "worker": "fdr3-worker0", "ctm": "fdr3-ctm"}


def comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # field 4, after the "(comm)" that may hold spaces


def alive(pid: int) -> bool:
    """Running or stopped, not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, parents before children."""
    parent_of: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            ppid = _ppid(int(name))
            if ppid is not None:
                parent_of[int(name)] = ppid
    out, frontier = [], [pid]
    while frontier:
        kids = sorted(p for p, pp in parent_of.items() if pp in frontier)
        out.extend(kids)
        frontier = kids
    return [p for p in out if alive(p)]


def server_roles(server_pid: int) -> dict[str, int]:
    """{"api": pid, "engine": pid, "worker": pid (rank 0), "ctm": pid} for the roles that are running."""
    roles = {"api": server_pid}
    for pid in descendants(server_pid):
        for role, name in ROLE_COMMS.items():
            if comm(pid) == name:
                roles[role] = pid
    return roles


def wait_for_roles(server_pid: int, wanted: tuple[str, ...], timeout_s: float = 60.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        roles = server_roles(server_pid)
        if all(r in roles for r in wanted) or time.monotonic() > deadline:
            return roles
        time.sleep(0.1)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_for(pid: int, seconds: float) -> None:
    """SIGSTOP, wait, SIGCONT (blocking; run it in a thread to keep a load going)."""
    try:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(seconds)
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass  # killed while stopped (e.g. replaced by its supervisor): nothing to resume


@dataclass
class Leftovers:
    processes: list[str] = field(default_factory=list)  # "pid (comm)"
    segments: list[str] = field(default_factory=list)
    ipc_dirs: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.processes) + len(self.segments) + len(self.ipc_dirs)

    def __str__(self) -> str:
        return f"processes {self.processes}, segments {self.segments}, IPC dirs {self.ipc_dirs}"


def leftovers(roles: dict[str, int], pids: list[int]) -> Leftovers:
    """What is left of a server tree that should be gone: `roles` and `pids` as seen while it ran."""
    engine_pid = roles.get("engine")
    try:
        shm = os.listdir(SHM_DIR)
    except OSError:
        shm = []
    segments = sorted(n for n in shm if engine_pid is not None and n.startswith(f"fdr3_{engine_pid}_"))
    tmp = tempfile.gettempdir()
    ipc = sorted(os.path.join(tmp, n) for n in os.listdir(tmp) if n.startswith(f"fdr3_ipc_p{roles['api']}-"))
    procs = [f"{p} ({comm(p)})" for p in sorted(set(pids)) if alive(p)]
    return Leftovers(procs, segments, ipc)


def wait_no_leftovers(roles: dict[str, int], pids: list[int], timeout_s: float) -> Leftovers:
    deadline = time.monotonic() + timeout_s
    while True:
        left = leftovers(roles, pids)
        if left.count == 0 or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


# -- the KV storage directory on a private tmpfs ------------------------------------------------------


def _userns_flags() -> list[str]:
    return [] if os.geteuid() == 0 else ["--user", "--map-root-user"]


def in_private_tmpfs(cmd: list[str], directory: str, size_bytes: int) -> list[str]:
    """`cmd` run in its own mount namespace with a tmpfs of `size_bytes` on `directory` (same pid: exec)."""
    os.makedirs(directory, exist_ok=True)
    script = 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"'
    return ["unshare", *_userns_flags(), "--mount", "--propagation", "private", "sh", "-c", script, "sh",
            str(size_bytes), directory, *cmd]


_CORRUPT = """
import os, sys
n = 0
for root, _, files in os.walk(sys.argv[1]):
    for name in files:
        path = os.path.join(root, name)
        with open(path, "r+b") as f:
            data = bytearray(f.read())
            if data:
                data[len(data) // 2] ^= 0xFF
                f.seek(0)
                f.write(data)
                n += 1
print(n)
"""


class StorageFaults:
    """Faults of a directory mounted by `in_private_tmpfs`, applied inside the server's namespace."""

    def __init__(self, server_pid: int, directory: str) -> None:
        self.server_pid = server_pid
        self.directory = directory

    def _run(self, *cmd: str) -> str:
        userns = ["-U", "--preserve-credentials"] if os.geteuid() != 0 else []
        out = subprocess.run(["nsenter", "-t", str(self.server_pid), "-m", *userns, "--", *cmd],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} in the server's mount namespace failed: {out.stderr.strip()}")
        return out.stdout

    def fill(self) -> None:
        """Write a filler file until the tmpfs is full (ENOSPC for every later write)."""
        self._run("sh", "-c", f'cat /dev/zero > "{self.directory}/.fill" 2>/dev/null; true')

    def unfill(self) -> None:
        self._run("rm", "-f", f"{self.directory}/.fill")

    def read_only(self) -> None:
        self._run("mount", "-o", "remount,ro", self.directory)

    def read_write(self) -> None:
        self._run("mount", "-o", "remount,rw", self.directory)

    def corrupt(self) -> int:
        """Flip one byte in the middle of every stored file; returns how many."""
        return int(self._run(sys.executable, "-c", _CORRUPT, self.directory).strip() or 0)

    def count_files(self) -> int:
        return int(self._run("sh", "-c", f'find "{self.directory}" -type f ! -name .fill | wc -l').strip())
