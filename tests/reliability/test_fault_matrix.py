"""The fault matrix of issue 11, against the real server (tiny model, R3 in debug mode) under load.

    process faults   SIGKILL and SIGSTOP of the API server, the engine, worker rank 0 and the CTM
    store faults     Redis stopped (as KV tier; as R3 p2pstore); the KV storage directory full,
                     read-only, corrupt (a private tmpfs in the server's own mount namespace)

Every case asserts: no request waits past HANG_S; a request fails only when the fault could reach it,
and then with a message that says what failed; R3 is exact for every request served (debug mode makes
row i hold its position); and after the server is gone, none of its processes, /dev/shm segments or
IPC directory is left. A fault the server survives must leave it serving (and the CTM replaced); a
fault it cannot survive (engine or worker lost) must make it exit with code 1 and a clear log line,
so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator

import faults
import httpx
import pytest
from api_server_process import ServerHandle, api_server
from redis_server import redis_pid, redis_server
from soak_load import CLEAR, CUT, OK, REFUSED, Load, Outcome, Target

HANG_S = 60.0  # well past every deadline below plus a request's own time on a loaded 2-core machine
# Deadlines short enough to fire within a test, long enough that a starved 2-core machine never trips
# the worker deadline by itself (a tiny-model step takes milliseconds); where no worker is faulted it is
# left long. The stall deadline stays 4 s above the worker deadline: an engine waiting out a stopped
# worker is silent until its own deadline fires, and must be the one to say "worker rank 0".
FATAL_DEADLINES = ("--worker-step-timeout-s", "6", "--engine-stall-timeout-s", "10", "--storage-timeout-s", "1",
                   "--transfer-timeout-s", "5")
DEADLINES = ("--worker-step-timeout-s", "60", "--engine-stall-timeout-s", "90", "--storage-timeout-s", "1",
             "--transfer-timeout-s", "4")
SMALL_CACHE = ("--block-size", "4", "--num-gpu-blocks-override", "40", "--num-cpu-blocks-override", "16",
               "--max-model-len", "128")
KINDS = ("plain", "stream", "n2")
# a fatal fault comes at the first token of a "held" stream, so the held streams and, on a loaded
# machine, the others are still running when it hits
HELD_KINDS = ("held", "long", "stream", "held", "n2", "long")


def r3_config(**extra: object) -> str:
    return json.dumps({"enable_routing_replay": True, "debug_mode": True, "store_timeout_s": 2, **extra})


@pytest.fixture(scope="module")
def model_dir(fake_model_dir: Callable[..., str]) -> str:
    return fake_model_dir("qwen3_moe")


def drive(target: Target, n: int, fault: Callable[[], object] | None = None, after_s: float = 0.5,
          seed: int = 0, kinds: tuple[str, ...] = KINDS) -> list[Outcome]:  # fmt: skip
    """n requests at once (kinds in turn); `fault` runs in a thread `after_s` into the load, or, when
    `kinds` has a "held" stream, as soon as one has its first token (a tiny model serves a short
    request in a tenth of a second: a fixed delay missed them all)."""

    async def run() -> list[Outcome]:
        load = Load(seed, hang_after_s=HANG_S)
        async with httpx.AsyncClient(timeout=None) as client:
            tasks = [asyncio.create_task(load.one(client, target, kinds[i % len(kinds)])) for i in range(n)]
            if fault is not None:
                if "held" in kinds:
                    await asyncio.wait_for(load.held_event().wait(), HANG_S)
                else:
                    await asyncio.sleep(after_s)
                await asyncio.to_thread(fault)
            return list(await asyncio.gather(*tasks))

    return asyncio.run(run())


def assert_all_served(outcomes: list[Outcome], srv: ServerHandle | None = None) -> None:
    bad = [o for o in outcomes if o.outcome != OK]
    log = f"\nthe server log ends:\n{srv.log_tail(60)}" if bad and srv is not None else ""
    assert not bad, f"{len(bad)} of {len(outcomes)} not served: {bad[:3]}{log}"


def server_tree(srv: ServerHandle) -> tuple[dict[str, int], list[int]]:
    roles = faults.wait_for_roles(srv.proc.pid, ("engine", "worker", "ctm"), 30)
    return roles, [srv.proc.pid, *faults.descendants(srv.proc.pid)]


def assert_nothing_left(roles: dict[str, int], pids: list[int], within_s: float = 20.0) -> None:
    left = faults.wait_no_leftovers(roles, pids, within_s)
    assert left.count == 0, f"left behind: {left}"


def wait_exit(srv: ServerHandle, within_s: float) -> int:
    try:
        return srv.proc.wait(timeout=within_s)
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"the server did not exit within {within_s} s:\n{srv.log_tail()}") from e


# -- faults the server cannot survive: each case has a server of its own ------------------------------

FATAL = {
    # role, action, what a failed request must say
    "engine-kill": ("engine", "kill", "engine process"),
    "engine-stop": ("engine", "stop", "did not answer"),
    "worker-kill": ("worker", "kill", "worker rank 0"),
    "worker-stop": ("worker", "stop", "worker rank 0"),
}


@pytest.mark.parametrize("case", sorted(FATAL))
def test_a_lost_engine_fails_requests_clearly_and_the_server_exits_1_leaving_nothing(
    case: str, model_dir: str, tmp_path
) -> None:
    role, action, says = FATAL[case]
    with api_server(model_dir, str(tmp_path), "--routing-replay-config", r3_config(), *SMALL_CACHE,
                    "--kv-storage", f"file://{tmp_path}/kv", *FATAL_DEADLINES) as srv:
        roles, pids = server_tree(srv)

        def fault() -> None:
            os.kill(roles[role], signal.SIGKILL if action == "kill" else signal.SIGSTOP)

        target = Target(srv.url, server_alive=lambda: srv.proc.poll() is None)
        t0 = time.monotonic()
        outcomes = drive(target, 6, fault, kinds=HELD_KINDS)
        assert time.monotonic() - t0 < HANG_S
        assert {o.outcome for o in outcomes} <= {OK, CLEAR, REFUSED}, outcomes
        failed = [o for o in outcomes if o.outcome == CLEAR]
        assert failed, "the fault hit no request: inject it earlier"
        assert all(says in o.detail for o in failed), [o.detail for o in failed]
        assert wait_exit(srv, 30) == 1
        log = srv.log_tail(80)
        assert "the server exits with code 1 so that its supervisor restarts it" in log
        assert "fastdeploy_r3: error: the engine is gone (" in log and says in log
    assert_nothing_left(roles, pids)


def test_f4_sigkilled_api_server_under_load_leaves_no_process_segment_or_ipc_dir(model_dir: str, tmp_path) -> None:
    """F4: the engine used to block forever in a ZMQ send; now the whole tree follows its server."""
    with api_server(model_dir, str(tmp_path), "--routing-replay-config", r3_config(), *SMALL_CACHE,
                    "--kv-storage", f"file://{tmp_path}/kv", *DEADLINES) as srv:
        roles, pids = server_tree(srv)
        target = Target(srv.url, server_alive=lambda: srv.proc.poll() is None)
        outcomes = drive(target, 6, lambda: os.kill(srv.proc.pid, signal.SIGKILL), kinds=HELD_KINDS)
        assert {o.outcome for o in outcomes} <= {OK, CUT, REFUSED}, outcomes
        assert any(o.outcome == CUT for o in outcomes), "no request was in flight when the server died"
        assert_nothing_left(roles, pids, within_s=15)


# -- faults the server survives: one server per configuration, one case after the other --------------


@pytest.fixture(scope="module")
def file_tier_server(model_dir: str, tmp_path_factory, redis_url: str) -> Iterator[tuple[ServerHandle, str]]:
    """KV storage tier on a 4 MiB private tmpfs, R3 to the p2pstore."""
    tmp = tmp_path_factory.mktemp("file_tier")
    storage = str(tmp / "kv")
    wrap = lambda cmd: faults.in_private_tmpfs(cmd, storage, 4 << 20)  # noqa: E731
    cfg = r3_config(routing_store_type="p2pstore", p2pstore_url=redis_url)
    with api_server(model_dir, str(tmp), "--routing-replay-config", cfg, *SMALL_CACHE, "--kv-storage",
                    f"file://{storage}", "--r3-namespace", "matrix", *DEADLINES, wrap=wrap) as srv:
        roles, pids = server_tree(srv)
        yield srv, storage
        pids = sorted(set(pids) | set(faults.descendants(srv.proc.pid)))
        roles = faults.server_roles(srv.proc.pid) | {"engine": roles["engine"]}
    assert_nothing_left(roles, pids)


def file_target(srv: ServerHandle, redis_url: str) -> Target:
    return Target(srv.url, (redis_url, "matrix"), server_alive=lambda: srv.proc.poll() is None)


SURVIVED = ("ctm-kill", "ctm-stop", "api-stop", "storage-full", "storage-read-only", "storage-corrupt")


@pytest.mark.parametrize("case", SURVIVED)
def test_a_survivable_fault_costs_no_request_and_r3_stays_exact(
    case: str, file_tier_server: tuple[ServerHandle, str], redis_url: str
) -> None:
    srv, storage = file_tier_server
    target = file_target(srv, redis_url)
    store = faults.StorageFaults(srv.proc.pid, storage)
    roles = faults.server_roles(srv.proc.pid)
    undo: Callable[[], object] = lambda: None  # noqa: E731
    if case == "ctm-kill":
        fault: Callable[[], object] = lambda: os.kill(roles["ctm"], signal.SIGKILL)  # noqa: E731
    elif case == "ctm-stop":
        fault = lambda: os.kill(roles["ctm"], signal.SIGSTOP)  # noqa: E731
    elif case == "api-stop":
        fault = lambda: faults.stop_for(srv.proc.pid, 3.0)  # noqa: E731
    elif case == "storage-full":
        fault, undo = store.fill, store.unfill
    elif case == "storage-read-only":
        fault, undo = store.read_only, store.read_write
    else:
        drive(target, 4, seed=1)  # the same prefixes as below, so stored blocks exist to be corrupted
        assert store.count_files() > 0
        fault = store.corrupt
    try:
        outcomes = drive(target, 8, fault, seed=1)
        assert_all_served(outcomes, srv)
        assert_all_served(drive(target, 2, seed=2), srv)  # and it keeps serving
    finally:
        undo()
    if case.startswith("ctm"):
        new_ctm = faults.wait_for_roles(srv.proc.pid, ("ctm",), 10).get("ctm")
        assert new_ctm is not None and new_ctm != roles["ctm"], "the CTM was not replaced"
        faults.kill(roles["ctm"])  # the stopped one was killed by the engine already; make sure
    health = httpx.get(f"{srv.url}/health", timeout=10).json()
    assert health["engine"] == "ok", health


def test_f8_f9_stopped_redis_as_r3_store_fails_only_deliveries_and_turns_ready_to_503(
    file_tier_server: tuple[ServerHandle, str], redis_url: str
) -> None:
    """p2pstore stopped: requests fail with a clear R3-store error within the store deadline (no hang);
    /health stays 200 but says the store is degraded; /ready is 503 (F9); both recover after SIGCONT."""
    srv, _ = file_tier_server
    target = file_target(srv, redis_url)
    pid = redis_pid(redis_url)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        outcomes = drive(target, 6)
        assert time.monotonic() - t0 < 20
        assert {o.outcome for o in outcomes} == {CLEAR}, outcomes
        assert all("R3 store" in o.detail for o in outcomes), [o.detail for o in outcomes]
        health = httpx.get(f"{srv.url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert "r3 store degraded" in health.json()["r3_store"]
        assert httpx.get(f"{srv.url}/ready", timeout=10).status_code == 503
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while httpx.get(f"{srv.url}/ready", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "ready did not come back after Redis resumed"
        time.sleep(0.5)
    assert_all_served(drive(target, 4, seed=3))


def test_f8_stopped_redis_as_kv_tier_stalls_nobody(model_dir: str, tmp_path) -> None:
    """KV tier on a Redis that is SIGSTOPped: lookups and puts miss after their deadline, off the engine
    loop; every request is served with exact R3, a prompt without a full block at once."""
    with redis_server() as url:
        pid = redis_pid(url)
        with api_server(model_dir, str(tmp_path), "--routing-replay-config", r3_config(), *SMALL_CACHE,
                        "--kv-storage", url, *DEADLINES) as srv:
            target = Target(srv.url, server_alive=lambda: srv.proc.poll() is None)
            assert_all_served(drive(target, 4))
            roles, pids = server_tree(srv)
            os.kill(pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [20, 21], "max_tokens": 2}, timeout=30)
                assert r.status_code == 200 and time.monotonic() - t0 < 5.0
                assert_all_served(drive(target, 6, seed=1))
                health = httpx.get(f"{srv.url}/health", timeout=10).json()
                assert "kv storage degraded" in health["kv_storage"], health
            finally:
                os.kill(pid, signal.SIGCONT)
            assert_all_served(drive(target, 2, seed=2))
        assert_nothing_left(roles, pids)
