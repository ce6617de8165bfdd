"""The soak's fault injector: one fault every --fault-every seconds, round robin over the names given."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import faults
from soak_control import control_fault
from soak_race import rollout_race

if TYPE_CHECKING:
    from soak import Server, Supervisor
    from soak_report import Stats

STORE_NAMESPACE = "soak"  # the p2pstore namespace both servers write R3 to


class FaultInjector:
    def __init__(self, sup: Supervisor, peer: Supervisor | None, redis_pid: int, args: argparse.Namespace,
                 stats: Stats) -> None:  # fmt: skip
        self.sup, self.peer, self.redis_pid, self.args, self.stats = sup, peer, redis_pid, args, stats
        self.busy: asyncio.Future | None = None  # the fault being injected (a thread: cancelling cannot stop it)

    async def finish(self, task: asyncio.Task) -> None:
        """Stop injecting; wait for the fault under way, so that stopping the servers does not cut it."""
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if self.busy is not None:
            await self.busy

    async def run(self, names: list[str]) -> None:
        i, race_owed = 0, False
        while not self.sup.stopping:
            await asyncio.sleep(self.args.fault_every)
            await self.sup.up.wait()
            srv = self.sup.server
            if srv is None or self.sup.stopping:
                continue
            if race_owed and srv.config == "A":
                name, race_owed = "rollout-race", False  # the race its turn found config B running
            else:
                name = names[i % len(names)]
                i += 1
                if name == "rollout-race" and srv.config != "A":
                    # config B returns R3 in the response: no store to race on. Owe the race to the next
                    # config-A start and inject the next fault in the round instead.
                    race_owed = True
                    name = names[i % len(names)]
                    i += 1
            if name.startswith("storage") and srv.storage_dir is None:
                name = "redis-stop"  # config B keeps KV in Redis: its storage fault is Redis stopping
            if name == "rollout-race":
                assert self.peer is not None  # started whenever rollout-race is among the faults
                await self.peer.up.wait()
            self.stats.faults[name] += 1
            self.stats.fault_log.append((time.monotonic(), name))
            self.busy = asyncio.ensure_future(asyncio.to_thread(self.inject, name, srv))
            await asyncio.shield(self.busy)

    def inject(self, name: str, srv: Server) -> None:
        hold = self.args.stop_seconds
        if name == "rollout-race":  # one rollout id sent to this server (twice) and to its peer at once
            peer = self.peer.server if self.peer is not None else None
            if peer is None:
                return  # the peer is restarting after all
            for outcome in rollout_race(srv.url, peer.url, self.sup.redis_url, STORE_NAMESPACE):
                self.stats.add(outcome)
            return
        if name in ("bad-checkpoint", "stalled-rendezvous", "dead-trainer"):  # refused, the server serving after
            self.stats.add(control_fault(name, srv.url, self.sup.model, self.sup.work))
            return
        target, action = name.rsplit("-", 1)
        if target in ("ctm", "worker", "engine", "api"):
            roles = faults.server_roles(srv.proc.pid)
            pid = roles.get(target)
            if pid is None:
                return
            srv.pids = sorted(set(srv.pids) | set(roles.values()))
            if action == "kill":
                faults.kill(pid)
            else:
                faults.stop_for(pid, hold if target == "ctm" else self.args.stop_fatal_seconds)
        elif name == "redis-stop":
            faults.stop_for(self.redis_pid, hold)
        else:
            storage = faults.StorageFaults(srv.proc.pid, srv.storage_dir)  # type: ignore[arg-type]
            with contextlib.suppress(RuntimeError):  # the server may have been restarted meanwhile
                if action == "full":
                    storage.fill()
                    time.sleep(hold)
                    storage.unfill()
                elif action == "ro":
                    storage.read_only()
                    time.sleep(hold)
                    storage.read_write()
                else:
                    storage.corrupt()
