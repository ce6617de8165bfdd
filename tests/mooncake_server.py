"""A real, throwaway Mooncake Store for tests: `mooncake_master` and `mooncake_client` from the wheel.

The master holds metadata only; objects live in segments that clients contribute. A `holder` (a
standalone `mooncake_client`) contributes a segment that outlives the engines of a test, as a
deployment's long-lived store nodes do; without one, objects vanish with the process that put them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

from api_server_process import free_port, stop_process


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


def _wait_listening(port: int, proc: subprocess.Popen, what: str, log: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log, errors="replace") as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening:\n{tail}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout} s (log: {log})")


@contextlib.contextmanager
def _process(argv: list[str], port: int, what: str, timeout: float) -> Iterator[None]:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # listeners advertise loopback, not the first NIC
    fd, log = tempfile.mkstemp(prefix=f"fdr3_{what}_", suffix=".log")
    with os.fdopen(fd, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        _wait_listening(port, proc, what, log, timeout)
        yield
    finally:
        stop_process(proc, 5)
        with contextlib.suppress(OSError):
            os.unlink(log)


@contextlib.contextmanager
def mooncake_master(*flags: str, timeout: float = 15.0) -> Iterator[str]:
    """Start mooncake_master (extra `--flag=value`s) on free 127.0.0.1 ports; yield `127.0.0.1:PORT`."""
    port, metrics_port = free_port(), free_port()
    argv = [_binary("mooncake_master"), f"--rpc_port={port}", "--rpc_address=127.0.0.1",
            f"--metrics_port={metrics_port}", "--metrics_host=127.0.0.1", "--rpc_thread_num=2", *flags]  # fmt: skip
    with _process(argv, port, "mooncake_master", timeout):
        yield f"127.0.0.1:{port}"


@contextlib.contextmanager
def mooncake_holder(master: str, segment: str = "256MB", timeout: float = 15.0) -> Iterator[None]:
    """A `mooncake_client` contributing `segment` of memory to `master` until the context exits."""
    port = free_port()
    argv = [_binary("mooncake_client"), f"--master_server_address={master}", "--metadata_server=P2PHANDSHAKE",
            "--host=127.0.0.1", f"--port={port}", f"--global_segment_size={segment}", "--protocol=tcp"]  # fmt: skip
    with _process(argv, port, "mooncake_client", timeout):
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
