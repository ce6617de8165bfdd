"""Fault-and-soak run: the real server with R3 in debug mode, a mixed load, faults on a schedule, one table.

    python tools/soak.py --requests 10000 --concurrency 16 --fault-every 20
    python tools/soak.py --minutes 30 --faults ctm-kill,redis-stop,storage-full

It starts its own redis-server and, when no --model is given, a tiny fake checkpoint; then runs the
API server as a supervisor would (restarting it whenever it exits), alternating two configurations
on each start so both R3 delivery paths see faults:

    config A   KV storage tier on a file directory (a private tmpfs, the tier bounded to 3/4 of it),
               R3 to the p2pstore (Redis)
    config B   KV storage tier on Redis, R3 in the response

Both have a CPU tier and a small GPU cache (swaps and preemption). With the rollout-race fault a
second server, the peer (config P: R3 to the same p2pstore, no storage tier), runs beside it,
supervised the same way, so that rollout ids race across two real servers. The load mixes shared prefixes,
n=2, streams, aborted streams, clients that disconnect and bad requests. Faults (round robin, one
every --fault-every seconds): SIGKILL or SIGSTOP of the CTM, a worker, the engine or the API server,
SIGSTOP of Redis, the storage directory full, read-only or corrupt, a rollout race (one rollout id
sent to both servers at once, twice to this one and once to the peer: one winner, the rest 409, the
store holding the winner's rows; tools/soak_race.py), and a trainer's control calls gone wrong (a cut
safetensors file to /update_weights_from_disk, a rendezvous to a closed port, a trainer SIGKILLed
mid-broadcast followed by a new group's complete push; tools/soak_control.py).
Debug mode makes every R3 row checkable without a reference: row i of a request holds position routed_experts_start + i.

The first SIGTERM or Ctrl-C ends the load early (requests under way finish, the table is printed); a
second one interrupts at once. A progress line goes to stderr every --progress-every seconds.

Every request ends in exactly one row of the table; "hung", "wrong R3 rows", "unclear errors" and
"leaked ..." must be 0 (the exit code is 1 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TOOLS_DIR)
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, TOOLS_DIR)
sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))  # the process launchers the tests use

import faults  # noqa: E402
from api_server_process import free_port  # noqa: E402
from redis_server import redis_pid, redis_server  # noqa: E402
from soak_faults import STORE_NAMESPACE, FaultInjector  # noqa: E402
from soak_load import CLEAR, HUNG, MUST_BE_ZERO, REFUSED, Load, Target  # noqa: E402
from soak_report import Stats, table  # noqa: E402

ALL_FAULTS = ("ctm-kill", "redis-stop", "storage-full", "worker-kill", "ctm-stop", "storage-corrupt",
              "engine-stop", "storage-ro", "worker-stop", "engine-kill", "api-kill", "rollout-race",
              "bad-checkpoint", "stalled-rendezvous", "dead-trainer")
FATAL = {"worker-kill", "worker-stop", "engine-kill", "engine-stop", "api-kill"}  # the server exits


# -- the supervised server -------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    config: str  # "A", "B" or "P" (the peer)
    storage_dir: str | None
    roles: dict[str, int] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)


class Supervisor:
    """Starts the server, restarts it when it exits, and counts what each dead one left behind."""

    def __init__(self, args: argparse.Namespace, model: str, redis_url: str, work: str, stats: Stats,
                 configs: str = "AB", name: str = "server") -> None:  # fmt: skip
        self.args, self.model, self.redis_url, self.work, self.stats = args, model, redis_url, work, stats
        self.configs, self.name = configs, name  # the configurations it alternates; its logs' prefix
        self.server: Server | None = None
        self.up = asyncio.Event()
        self.starts = 0
        self.stopping = False

    def _command(self, port: int, config: str, storage_dir: str) -> list[str]:
        a = self.args
        r3 = {"enable_routing_replay": True, "debug_mode": True, "store_timeout_s": a.store_timeout}
        if config in "AP":
            r3.update(routing_store_type="p2pstore", p2pstore_url=self.redis_url, ttl_s=600)
        kv = {"A": f"file://{storage_dir}", "B": self.redis_url.rsplit("/", 1)[0] + "/1", "P": None}[config]
        cmd = [sys.executable, "-m", "fastdeploy_r3.entrypoints.openai.api_server", "--model", self.model,
               "--port", str(port), "--device", "cpu", "--block-size", "4",
               "--num-gpu-blocks-override", str(a.gpu_blocks), "--num-cpu-blocks-override", "64",
               "--max-model-len", "128",
               "--routing-replay-config", json.dumps(r3), "--r3-namespace", STORE_NAMESPACE,
               "--worker-step-timeout-s", str(a.step_timeout), "--storage-timeout-s", str(a.store_timeout),
               "--transfer-timeout-s", str(a.transfer_timeout), "--engine-stall-timeout-s", str(a.stall_timeout)]
        if kv is not None:
            cmd += ["--kv-storage", kv]
        if config == "A":
            # the tier keeps to 3/4 of its tmpfs (least recently used blocks out), so only the
            # storage faults fill the disk, not the soak's own blocks
            cmd += ["--kv-storage-capacity-gib", f"{a.storage_bytes * 0.75 / 2**30:.6f}"]
            return faults.in_private_tmpfs(cmd, storage_dir, a.storage_bytes)
        return cmd

    async def start(self) -> None:
        config = self.configs[self.starts % len(self.configs)]
        self.starts += 1
        port = free_port()
        storage_dir = os.path.join(self.work, f"{self.name}-kv{self.starts}")
        log = open(os.path.join(self.work, f"{self.name}{self.starts}.log"), "w")  # noqa: SIM115 - the child owns it
        env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.Popen(self._command(port, config, storage_dir), stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=REPO_ROOT)
        log.close()
        srv = Server(proc, f"http://127.0.0.1:{port}", config, storage_dir if config == "A" else None)
        try:
            await self._wait_healthy(srv)
        except BaseException:  # a soak stopped (Ctrl-C, SIGTERM) while this one started: it must not outlive it
            stop_tree(proc)
            raise
        srv.roles = faults.wait_for_roles(proc.pid, ("engine", "worker", "ctm"), 30)
        srv.pids = [proc.pid, *faults.descendants(proc.pid)]
        self.server = srv
        self.up.set()

    async def _wait_healthy(self, srv: Server) -> None:
        deadline = time.monotonic() + 300
        async with httpx.AsyncClient(timeout=2.0) as c:
            while True:
                if srv.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {srv.proc.returncode} during start-up; see {self.work}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get(f"{srv.url}/health")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not healthy within 300 s; see {self.work}")
                await asyncio.sleep(0.2)

    async def watch(self) -> None:
        """Restart the server whenever it exits; sample the tree's RSS."""
        t0 = time.monotonic()
        last_rss = -1e9
        while not self.stopping:
            srv = self.server
            if srv is not None and srv.proc.poll() is not None:
                self.up.clear()
                self.server = None
                await asyncio.to_thread(self.account_leftovers, srv)
                self.stats.restarts += 1
                if not self.stopping:
                    await self.start()
                continue
            if srv is not None and not self.up.is_set() and await self._answers(srv):
                self.up.set()  # a refusal cleared it but this server still serves
            if srv is not None and time.monotonic() - last_rss >= self.args.rss_every:
                last_rss = time.monotonic()
                self.stats.rss.append((last_rss - t0, tree_rss_mib(srv.proc.pid)))
            await asyncio.sleep(0.2)

    async def _answers(self, srv: Server) -> bool:
        async with httpx.AsyncClient(timeout=2.0) as c:
            try:
                return (await c.get(f"{srv.url}/health")).status_code == 200
            except httpx.HTTPError:
                return False

    def account_leftovers(self, srv: Server) -> None:
        srv.pids = sorted(set(srv.pids) | set(faults.descendants(srv.proc.pid)))
        left = faults.wait_no_leftovers(srv.roles, srv.pids, self.args.leak_grace)
        self.stats.leaked_processes += len(left.processes)
        self.stats.leaked_segments += len(left.segments)
        self.stats.leaked_ipc_dirs += len(left.ipc_dirs)
        if left.count:
            self.stats.leak_examples.append(f"server {srv.proc.pid}: {left}")
            for p in srv.pids:  # do not let one leak snowball into the next runs
                faults.kill(p)

    async def stop(self) -> None:
        self.stopping = True
        srv = self.server
        if srv is None:
            return
        srv.pids = sorted(set(srv.pids) | set(faults.descendants(srv.proc.pid)))
        srv.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(srv.proc.wait, 60)
        except subprocess.TimeoutExpired:
            self.stats.leak_examples.append(f"server {srv.proc.pid} did not stop within 60 s of SIGTERM")
            srv.proc.kill()
        await asyncio.to_thread(self.account_leftovers, srv)


def stop_tree(proc: subprocess.Popen) -> None:
    """SIGTERM (the server stops its engine, workers and CTM), then SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def tree_rss_mib(pid: int) -> float:
    total = 0
    for p in [pid, *faults.descendants(pid)]:
        with contextlib.suppress(OSError):
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return total / 2**20


# -- the load --------------------------------------------------------------------------------------


class Clients:
    """--concurrency loops of requests; each waits while the supervisor restarts the server."""

    def __init__(self, sup: Supervisor, stats: Stats, args: argparse.Namespace) -> None:
        self.sup, self.stats, self.args = sup, stats, args
        self.load = Load(args.seed, args.hang_after)

    async def one(self, client: httpx.AsyncClient) -> None:
        while True:
            await self.sup.up.wait()
            srv = self.sup.server
            if srv is not None:
                break
        r3_store = (self.sup.redis_url, STORE_NAMESPACE) if srv.config == "A" else None
        target = Target(srv.url, r3_store, server_alive=lambda: srv.proc.poll() is None)
        sent = time.monotonic()
        outcome = await self.load.one(client, target)
        self.stats.add(outcome)
        if outcome.outcome == HUNG:
            self.stats.hung_sent.append((sent, outcome.kind))
        if outcome.outcome == CLEAR and outcome.detail.startswith("503"):
            await asyncio.sleep(0.5)  # the server cannot serve for now (weights mixed, engine gone): back off
        if outcome.outcome == REFUSED:
            # the server is on its way out: wait for the supervisor's restart instead of burning requests
            if self.sup.server is srv:
                self.sup.up.clear()
            await asyncio.sleep(0.5)


# -- main ------------------------------------------------------------------------------------------


def make_model(work: str) -> str:
    try:
        from fake_model import make_fake_model  # tools/fake_model.py
    except ImportError:
        from fastdeploy_r3.model_executor.fake_model import make_fake_model
    return make_fake_model("qwen3_moe", os.path.join(work, "model"), preset="tiny")


async def soak(args: argparse.Namespace, work: str) -> Stats:
    stats = Stats()
    with redis_server() as redis_url:
        return await _soak(args, work, stats, redis_url, redis_pid(redis_url))


async def _soak(args: argparse.Namespace, work: str, stats: Stats, redis_url: str, redis_server_pid: int) -> Stats:
    model = args.model or make_model(work)
    sup = Supervisor(args, model, redis_url, work, stats)
    names = [f for f in args.faults.split(",") if f]
    # the rollout race needs a second server on the same Redis: the peer, never faulted itself
    peer = Supervisor(args, model, redis_url, work, stats, configs="P", name="peer") if "rollout-race" in names \
        else None
    t_end = time.monotonic() + args.minutes * 60 if args.minutes else None
    watchers = []
    try:
        await asyncio.gather(*[s.start() for s in (sup, peer) if s is not None])
        watchers = [asyncio.create_task(s.watch()) for s in (sup, peer) if s is not None]
        injector = FaultInjector(sup, peer, redis_server_pid, args, stats)
        injecting = asyncio.create_task(injector.run(names)) if names else None
        clients = Clients(sup, stats, args)
        issued = 0
        stop_early = _stop_on_first_signal()

        def more_to_do() -> bool:
            if stop_early.is_set():
                return False
            if sum(stats.faults.values()) < args.min_faults:
                return True  # a short run (make test) must still meet every fault it names
            return (args.requests is None or issued < args.requests) and (t_end is None or time.monotonic() < t_end)

        async def client_loop() -> None:
            nonlocal issued
            async with httpx.AsyncClient(timeout=None) as client:
                while more_to_do():
                    issued += 1
                    await clients.one(client)

        async def progress() -> None:
            t0 = time.monotonic()
            while True:
                await asyncio.sleep(args.progress_every)
                bad = sum(stats.outcomes.get(k, 0) for k in MUST_BE_ZERO)
                print(f"[soak {time.monotonic() - t0:.0f} s] {sum(stats.outcomes.values())} requests ended, "
                      f"{bad} hung/wrong/unclear, {sum(stats.faults.values())} faults, {stats.restarts} restarts",
                      file=sys.stderr, flush=True)

        reporter = asyncio.create_task(progress())
        await asyncio.gather(*[client_loop() for _ in range(args.concurrency)])
        reporter.cancel()
        if injecting is not None:
            await injector.finish(injecting)
        for s in (sup, peer):
            if s is not None:
                s.stopping = True
        await asyncio.sleep(0.5)
        for w in watchers:
            w.cancel()
        await asyncio.gather(*[s.stop() for s in (sup, peer) if s is not None])
    finally:
        for s in (sup, peer):
            if s is not None:
                s.stopping = True
                if s.server is not None and s.server.proc.poll() is None:
                    s.server.proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(redis_server_pid, signal.SIGCONT)  # a stopped redis-server could not take redis_server()'s SIGTERM
    return stats


def _stop_on_first_signal() -> asyncio.Event:
    """The first SIGTERM or SIGINT ends the load early: requests under way finish, the servers stop and
    the table is printed as usual. A second one interrupts at once (KeyboardInterrupt)."""
    loop, stop = asyncio.get_running_loop(), asyncio.Event()

    def first(sig: int) -> None:
        print(f"signal {sig}: finishing the requests under way; send it again to interrupt", file=sys.stderr)
        stop.set()
        for s in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(s)
            signal.signal(s, signal.default_int_handler)

    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, first, s)
    return stop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=None, help="stop after this many requests")
    p.add_argument("--minutes", type=float, default=None, help="stop after this long")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--faults", default=",".join(ALL_FAULTS), help=f"comma list from {', '.join(ALL_FAULTS)}")
    p.add_argument("--fault-every", type=float, default=20.0, help="seconds between faults")
    p.add_argument("--min-faults", type=int, default=0,
                   help="keep the load going past --requests / --minutes until this many faults were injected")
    p.add_argument("--stop-seconds", type=float, default=4.0, help="how long SIGSTOP / full / read-only last")
    p.add_argument("--stop-fatal-seconds", type=float, default=45.0,
                   help="SIGSTOP of an engine or worker (longer than the deadlines that must catch it)")
    p.add_argument("--step-timeout", type=float, default=20.0, help="the server's worker step deadline")
    p.add_argument("--stall-timeout", type=float, default=30.0, help="the API server's engine stall deadline")
    p.add_argument("--store-timeout", type=float, default=2.0, help="deadline of one store operation")
    p.add_argument("--transfer-timeout", type=float, default=5.0, help="deadline of one CTM transfer")
    p.add_argument("--storage-bytes", type=int, default=8 << 20, help="size of config A's storage tmpfs")
    p.add_argument("--gpu-blocks", type=int, default=96, help="KV blocks of 4 tokens (small: swaps, preemption)")
    p.add_argument("--hang-after", type=float, default=90.0, help="a request without an answer this long hung")
    p.add_argument("--leak-grace", type=float, default=20.0, help="seconds a dead server has to clean up")
    p.add_argument("--rss-every", type=float, default=10.0)
    p.add_argument("--progress-every", type=float, default=60.0, help="seconds between progress lines (stderr)")
    p.add_argument("--model", default=None, help="model directory (default: a tiny fake Qwen3-MoE)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the work directory (server logs)")
    args = p.parse_args(argv)
    if args.requests is None and args.minutes is None:
        args.requests = 1000
    # until the load starts, SIGTERM unwinds like Ctrl-C, through the finally that stops the server tree
    # and redis-server; from then on the first one ends the load early and the table is still printed
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    work = tempfile.mkdtemp(prefix="fdr3_soak_")
    t0 = time.monotonic()
    stats = asyncio.run(soak(args, work))
    print(table(stats, time.monotonic() - t0))
    bad = sum(stats.outcomes.get(k, 0) for k in MUST_BE_ZERO)
    bad += stats.leaked_processes + stats.leaked_segments + stats.leaked_ipc_dirs
    if args.keep or bad:
        print(f"server logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
