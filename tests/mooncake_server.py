"""A real, throwaway Mooncake Store for tests: `mooncake_master` and `mooncake_client` from the wheel.

The master holds metadata only; objects live in segments that clients contribute. A `holder` (a
standalone `mooncake_client`) contributes a segment that outlives the engines of a test, as a
deployment's long-lived store nodes do; without one, objects vanish with the process that put them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

from api_server_process import free_port, listens_itself, stop_process


class MooncakeMissing(RuntimeError):
    pass


def _binary(name: str) -> str:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise MooncakeMissing(
            "the mooncake package is not installed; run `make mooncake` (pip install "
            "mooncake-transfer-engine-non-cuda==0.3.13.post1 and apt-get install -y libibverbs1)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], name)
    if not os.path.isfile(path):
        raise MooncakeMissing(f"{path} is missing from the mooncake wheel; reinstall it with `make mooncake`")
    if not os.access(path, os.X_OK):
        os.chmod(path, 0o755)
    return path


def _log_tail(log: str) -> str:
    with open(log, errors="replace") as f:
        return f.read()[-2000:]


def _wait_listening(port: int, proc: subprocess.Popen, what: str, log: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening:\n{_log_tail(log)}")
        if listens_itself(proc.pid, port):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout} s:\n{_log_tail(log)}")


def _start(argv_for: Callable[[int], list[str]], what: str, timeout: float) -> tuple[subprocess.Popen, str, int]:
    """Start argv_for(port) on a free port and wait until it listens there itself: (process, log, port). A
    port taken by another process between free_port() and the bind is retried on a new one (twice)."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # listeners advertise loopback, not the first NIC
    for attempt in range(3):
        port = free_port()
        fd, log = tempfile.mkstemp(prefix=f"fdr3_{what}_", suffix=".log")
        with os.fdopen(fd, "wb") as out:
            proc = subprocess.Popen(argv_for(port), stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
        try:
            _wait_listening(port, proc, what, log, timeout)
            return proc, log, port
        except RuntimeError:
            stop_process(proc, 5)
            with contextlib.suppress(OSError):
                os.unlink(log)
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _process(argv_for: Callable[[int], list[str]], what: str, timeout: float) -> Iterator[int]:
    """The started process (_start) until the context exits; yields its port."""
    proc, log, port = _start(argv_for, what, timeout)
    try:
        try:
            yield port
        except BaseException:
            # what the process said is the first thing to read when a test using it fails
            state = "running" if proc.poll() is None else f"exited with {proc.returncode}"
            print(f"--- {what} on 127.0.0.1:{port} ({state}), its log's tail:\n{_log_tail(log)}", file=sys.stderr)
            raise
    finally:
        stop_process(proc, 5)
        with contextlib.suppress(OSError):
            os.unlink(log)


@contextlib.contextmanager
def mooncake_master(*flags: str, timeout: float = 15.0) -> Iterator[str]:
    """Start mooncake_master (extra `--flag=value`s) on free 127.0.0.1 ports; yield `127.0.0.1:PORT`."""
    binary = _binary("mooncake_master")

    def argv(port: int) -> list[str]:
        return [binary, f"--rpc_port={port}", "--rpc_address=127.0.0.1", f"--metrics_port={free_port()}",
                "--metrics_host=127.0.0.1", "--rpc_thread_num=2", *flags]  # fmt: skip

    with _process(argv, "mooncake_master", timeout) as port:
        yield f"127.0.0.1:{port}"


@contextlib.contextmanager
def mooncake_holder(master: str, segment: str = "256MB", timeout: float = 15.0) -> Iterator[None]:
    """A `mooncake_client` contributing `segment` of memory to `master` until the context exits."""
    binary = _binary("mooncake_client")

    def argv(port: int) -> list[str]:
        return [binary, f"--master_server_address={master}", "--metadata_server=P2PHANDSHAKE", "--host=127.0.0.1",
                f"--port={port}", f"--global_segment_size={segment}", "--protocol=tcp"]  # fmt: skip

    with _process(argv, "mooncake_client", timeout):
        yield


def mooncake_url(master: str, **params: str) -> str:
    """`mooncake://master?metadata=P2PHANDSHAKE&protocol=tcp&...` with `params` appended."""
    query = {"metadata": "P2PHANDSHAKE", "protocol": "tcp", **params}
    return f"mooncake://{master}?" + "&".join(f"{k}={v}" for k, v in query.items())


def raw_client(master: str, segment: int = 0):  # -> mooncake.store.MooncakeDistributedStore
    """A bare Mooncake client (no framing, no checks), for tests that write what the product never would."""
    from mooncake.store import MooncakeDistributedStore

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    client = MooncakeDistributedStore()
    rc = client.setup("127.0.0.1", "P2PHANDSHAKE", segment, 64 << 20, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"cannot join mooncake_master at {master}: setup returned {rc}")
    return client


def flush_all(url: str) -> None:
    """Remove every object (forced), as `redis FLUSHDB` does between parametrizations."""
    client = raw_client(url.split("://", 1)[1].split("?", 1)[0])
    try:
        client.remove_all(True)
    finally:
        client.close()
