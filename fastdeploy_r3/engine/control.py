"""The engine's RL control plane: pause / continue, flush, and weight updates with version isolation
(SGLang's control endpoints; docs/rl_control.md lists them).

One weight update, between two engine steps:

    abort_all_requests?  → every request in flight finishes "abort" (a clear message, no R3)
    workers load         → each rank checks names/shapes first (a bad update changes nothing),
                           then takes its shard from the disk / the trainer's broadcast / the tensors
    new weight_version   → the root of every block hash from now on: the GPU prefix cache and the
                           CPU tier are flushed, storage keys of the old version are never looked up
    requests in flight   → continue under the new weights (after /continue_generation when paused
                           in place); their outputs carry the versions that sampled which tokens
                           (`weight_versions`) and `spans_weight_versions`, never a silent mix

A failure after some parameters changed leaves no trustworthy weights: every request in flight is
aborted with that message, and new ones are refused until an update succeeds. A refused update
(nothing changed) aborts nothing: `abort_all_requests` takes effect only once the new weights are in,
before the next step runs, so no request ever computes with them.

Versions: the caller's name, else the next integer (a counter, never a concatenation). A whole
checkpoint (disk) under the current name is idempotent (nothing reloaded) unless `force`. Tensors and
broadcasts arrive in buckets that all name the version being pushed, so under the current name they
load as its next part. Either reload keeps the name but takes a fresh internal cache root, so KV of
the replaced weights is never hit.

A control call waits for the workers while the engine keeps heartbeating (`heartbeat`, run by the
engine loop: the API server's stall watchdog sees an engine at work, and health queries are answered);
the workers bound each blocking step (rendezvous, broadcast) by worker_step_timeout_s, shorter than
that watchdog, and tear a stalled group down.

EngineControl sees the engine through three narrow collaborators (the Protocols below), so it never
imports the loop that owns it: the requests in flight, the prefix cache it flushes and re-roots, and
the workers it calls. It owns the runtime state the commands change: the pause mode, the current
weight version, whether the weights are usable and what memory is released (memory_control.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from fastdeploy_r3.cache_manager.block_hash import root_hash
from fastdeploy_r3.engine.control_error import EngineControlError
from fastdeploy_r3.engine.memory_control import MemoryControl
from fastdeploy_r3.engine.messages import ExpertLoadReport, WeightsReport
from fastdeploy_r3.engine.request import Request, WeightVersionEvent
from fastdeploy_r3.engine.worker_group import PerRank
from fastdeploy_r3.model_executor.layers.expert_placement import ExpertPlacement
from fastdeploy_r3.worker.messages import (
    EXPERT_DISTRIBUTION_ACTIONS,
    ChecksumWeights,
    DestroyWeightUpdateGroup,
    ExpertDistribution,
    ExpertDistributionResult,
    ExpertRebalanceResult,
    InitWeightUpdateGroup,
    RebalanceExperts,
    UpdateWeights,
    WeightsChecksum,
    WeightUpdateResult,
)

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "in_place", "retract")
# a rendezvous waits for the trainer; a broadcast of a large model takes a while
_WEIGHT_CALL_TIMEOUT_S = 3600.0


class ControlledRequests(Protocol):
    """The requests in flight, as the control plane sees them (EngineService)."""

    def request_ids(self) -> list[str]: ...

    def abort_request(self, request_id: str, message: str | None = None) -> None: ...

    def unfinished_requests(self) -> list[Request]: ...

    def retract_running(self) -> None: ...  # running requests back to waiting, their KV freed

    def drain(self) -> None: ...  # collect the step in flight (overlap scheduling), if any


class ControlledCache(Protocol):
    """The prefix cache: flushed by /flush_cache, re-rooted by a new weight version (PrefixCacheManager)."""

    def flush(self) -> int: ...

    def reset_root(self, root_hash: bytes) -> None: ...


class ControlledWorkers(Protocol):
    """Every worker rank, one answer each in rank order (WorkerGroup)."""

    def call(self, msg: object, timeout: float | None = None,
             while_waiting: Callable[[], None] | None = None) -> list[Any]: ...


class EngineControl:
    def __init__(
        self,
        requests: ControlledRequests,
        cache: ControlledCache,
        workers: ControlledWorkers,
        model_identity: str,
        weight_version: str,
        has_kv_tiers: bool = False,
        placements: list[ExpertPlacement] | None = None,
    ) -> None:
        """placements[r]: expert-parallel rank r's experts (a rebalance replaces them); None: every rank holds
        every tensor (or a shard of it)."""
        self.requests = requests
        self.cache = cache
        self.workers = workers
        self.model_identity = model_identity
        self.weight_version = weight_version  # roots the prefix cache; changed by weight updates only
        self.has_kv_tiers = has_kv_tiers  # a CPU or storage tier maps the KV cache: it cannot be released
        self.placements = placements
        self.last_update_tensors: list[int] = []  # tensors each rank loaded in the last weight update
        self.paused: str | None = None  # the pause mode while /pause_generation holds the engine
        self.weights_broken: str | None = None
        self.num_weight_updates = 0
        self.memory = MemoryControl(self)
        self.heartbeat: Callable[[], None] | None = None  # set by the engine loop: runs while workers work
        self.update_session_open = False  # between /begin_weight_update and /end_weight_update
        self.last_update_reloaded = True  # False: the last update named the current version, nothing reloaded
        self._weights_snapshot: list[dict[str, str]] | None = None
        self._version_counter = int(weight_version) if weight_version.isdigit() else 0

    # -- pause --------------------------------------------------------------------------------------

    def pause(self, mode: str) -> int:
        """Stop advancing requests; mode 'abort' also aborts every request in flight. Returns how many
        requests were aborted or are held."""
        if mode not in PAUSE_MODES:
            raise EngineControlError(f"pause mode {mode!r} is not supported; use one of {', '.join(PAUSE_MODES)}")
        # the step already sent (engine/overlap.py) is collected now: nothing advances once pause returns
        self.requests.drain()
        n = len(self.requests.request_ids())
        if mode == "abort":
            self.abort_all("aborted by /pause_generation (mode 'abort')")
        elif mode == "retract":
            # back to waiting with their KV freed (cached blocks stay cached): after continue_generation they
            # recompute, their R3 rows recomputed with them, under whatever weights are current then
            self.requests.retract_running()
        self.paused = mode
        return n

    def resume(self) -> None:
        self.paused = None

    def abort_all(self, message: str) -> None:
        for request_id in self.requests.request_ids():
            self.requests.abort_request(request_id, message)

    def flush_cache(self) -> int:
        return self.cache.flush()

    # -- weight update groups -------------------------------------------------------------------------

    def init_weight_update_group(self, cmd: InitWeightUpdateGroup) -> None:
        self._raise_on_errors(self.call_workers(cmd), f"joining weight update group {cmd.group_name!r}")

    def destroy_weight_update_group(self, cmd: DestroyWeightUpdateGroup) -> None:
        self._raise_on_errors(self.call_workers(cmd), f"leaving weight update group {cmd.group_name!r}")

    # -- weight updates -----------------------------------------------------------------------------

    def update_weights(
        self, source: UpdateWeights, weight_version: str | None, abort_all_requests: bool, force: bool = False
    ) -> str:
        """Load new weights on every rank and make weight_version (default: the next one) current.

        The prefix caches are always flushed (SGLang's flush_cache=False has no meaning here: entries of
        the old version could never be hit again, so keeping them would only hold blocks)."""
        old = self.weight_version
        # A whole checkpoint under the current name is those weights again (a trainer re-syncing a running
        # engine): nothing to do. Tensors and broadcasts come in buckets, each naming the version being
        # pushed (slime, miles): under the current name they are the next part of it and always load.
        whole = source.model_path is not None
        if weight_version == old and whole and not force and self.weights_broken is None \
                and not self.memory.weights_missing:
            self.last_update_reloaded = False
            return old
        new = self._next_version(old) if weight_version is None else weight_version
        if not new or len(new) > 128:
            raise EngineControlError(f"weight_version {new!r}: use 1-128 characters")
        if "weights" in self.memory.released:
            raise EngineControlError("the weights are released; call /resume_memory_occupation with the 'weights' "
                                     "tag first", status=409)
        results = self.call_workers(self._per_rank(source))
        self.last_update_tensors = [r.num_tensors for r in results]
        changed = any(r.weights_changed or (r.error is None and r.num_tensors) for r in results)
        errors = [r.error for r in results if r.error]
        if errors:
            if changed:
                self._break_weights(f"a weight update failed half way and left old and new weights mixed: {errors[0]}")
            raise EngineControlError(errors[0], invalid=not changed)
        if abort_all_requests:  # after the load, before any step: no request computes with the new weights
            self.abort_all("aborted for a weight update (abort_all_requests)")
        self._advance_version(old, new, reload=new == old)
        self.memory.weights_filled()
        self.last_update_reloaded = True
        return new

    def update_weight_version(self, new: str, abort_all_requests: bool) -> bool:
        """Name the current weights `new` (SGLang's /update_weight_version); False: it already was."""
        old = self.weight_version
        if new == old:
            return False
        if not new or len(new) > 128:
            raise EngineControlError(f"new_version {new!r}: use 1-128 characters")
        if abort_all_requests:
            self.abort_all("aborted for a weight version change (abort_all_requests)")
        self._advance_version(old, new)
        return True

    def check_weights(self, action: str, skip: list[str]) -> tuple[bool, str, WeightsReport]:
        """/weights_checker (engine/weight_check.py says the algorithm)."""
        from fastdeploy_r3.engine import weight_check

        if action not in weight_check.ACTIONS:
            raise EngineControlError(f"weights_checker action {action!r} is not supported; use one of "
                                     f"{', '.join(weight_check.ACTIONS)}")
        if "weights" in self.memory.released:
            raise EngineControlError("the weights are released; resume them first", status=409)
        results: list[WeightsChecksum] = self.call_workers(ChecksumWeights())
        errors = [r.error for r in results if r.error]
        if errors:
            raise EngineControlError("; ".join(errors), invalid=False)
        per_rank = [r.checksums for r in results]
        if action == "snapshot":
            self._weights_snapshot = per_rank
            return True, "snapshot taken (sha256 per parameter per rank)", weight_check.report(per_rank)
        if action == "compare":
            if self._weights_snapshot is None:
                raise EngineControlError("no snapshot to compare with; call action 'snapshot' first")
            diff = weight_check.compare(self._weights_snapshot, per_rank, skip)
            message = "weights equal the snapshot" if not diff else f"{len(diff)} parameters differ from the snapshot"
            return not diff, message, weight_check.report(per_rank, diff)
        return True, "sha256 per parameter per rank", weight_check.report(per_rank)

    def expert_distribution(self, action: str) -> tuple[str, ExpertLoadReport | None]:
        """Start, stop or dump the expert load record on every rank (model_executor/layers/expert_load.py).
        Every rank routes every token, so the ranks' counts must agree: the record is rank 0's, not a sum."""
        if action not in EXPERT_DISTRIBUTION_ACTIONS:
            raise EngineControlError(f"expert distribution action {action!r}; use one of "
                                     f"{', '.join(EXPERT_DISTRIBUTION_ACTIONS)}")
        self.requests.drain()  # a step in flight counts into the record it ran under
        results: list[ExpertDistributionResult] = self.call_workers(ExpertDistribution(action))
        errors = [r.error for r in results if r.error]
        if errors:
            raise EngineControlError("; ".join(errors), invalid=False)
        if action != "dump":
            return ("Start" if action == "start" else "Stop") + " recording the expert distribution.", None
        differ = [r.rank for r in results if r.counts != results[0].counts]
        if differ:
            raise EngineControlError(f"ranks {differ} counted other expert loads than rank 0; every rank routes "
                                     "every token, so this is a bug in the record", invalid=False)
        return "Dump expert distribution record.", ExpertLoadReport(results[0].counts or [], results[0].recording)

    def rebalance_experts(self) -> tuple[str, list[int]]:
        """EPLB: a placement of the same physical slots from the recorded expert load, the weights moved between
        the ranks (model_executor/layers/expert_rebalance.py). Same logical weights: the weight version and
        the prefix cache stay. Returns the message and the new physical_to_logical."""
        from fastdeploy_r3.model_executor.layers.expert_rebalance import rebalanced_placement

        if self.placements is None:
            raise EngineControlError("rebalancing experts needs expert parallelism: start the engine with "
                                     "--enable-expert-parallel (and --ep-num-redundant-experts for replicas)")
        if "weights" in self.memory.released:
            raise EngineControlError("the weights are released; resume them first", status=409)
        if self.weights_broken is not None:  # moving a partial update around would not repair it
            raise EngineControlError(f"{self.weights_broken}; push a complete update first", status=409)
        report = self.expert_distribution("dump")[1]
        assert report is not None
        load = [sum(col) for col in zip(*report.logical_count, strict=True)]  # [E] over every MoE layer
        if not any(load):
            raise EngineControlError("no expert load is recorded: call /start_expert_distribution_record and serve "
                                     "requests before /rebalance_experts", status=409)
        first = self.placements[0]
        p2l = rebalanced_placement(load, first.ep_size, first.num_local_experts)
        results: list[ExpertRebalanceResult] = self.call_workers(RebalanceExperts(p2l))
        errors = [f"rank {r.rank}: {r.error}" for r in results if r.error]
        if errors:  # some ranks may have moved and others not: their slots no longer agree
            self._break_weights(f"expert rebalance failed ({'; '.join(errors)})")
            raise EngineControlError(self.weights_broken or "", invalid=False)
        self.placements = [ExpertPlacement.redundant(p2l, first.num_experts, first.ep_size, r)
                           for r in range(first.ep_size)]
        moved = sum(r.bytes_received for r in results)
        return f"experts rebalanced over {first.ep_size} ranks; {moved} bytes moved between ranks", list(p2l)

    def check_weights_usable(self) -> None:
        if self.weights_broken is not None:
            raise EngineControlError(f"{self.weights_broken}; push a complete update before sending requests",
                                     invalid=False, status=503)
        why = self.memory.unavailable()
        if why is not None:
            raise EngineControlError(why, invalid=False, status=503)

    def health(self) -> dict[str, str]:
        """What /health should say about the control plane: {"weights" or "memory": why requests are
        refused}. A pause is not a fault: /health reports it as its status ("paused"), not as degraded."""
        out = {}
        if self.weights_broken is not None:
            out["weights"] = f"{self.weights_broken}; push a complete update"
        elif (why := self.memory.unavailable()) is not None:
            out["memory"] = why
        return out

    # -- internals ----------------------------------------------------------------------------------

    def _advance_version(self, old: str, new: str, reload: bool = False) -> None:
        for req in self.requests.unfinished_requests():
            req.weight_version_events.append(
                WeightVersionEvent(old, len(req.output_token_ids), req.num_computed_tokens)
            )
            req.weight_version = new
        self.weight_version = new
        # a forced reload under the same name gets a root of its own: KV of the replaced weights is never hit
        root_version = f"{new}\x00reload{self.num_weight_updates + 1}" if reload else new
        self.cache.reset_root(root_hash(self.model_identity, root_version))
        self.weights_broken = None
        self.num_weight_updates += 1
        logger.info("weight version %s -> %s", old, new)

    def _next_version(self, old: str) -> str:
        """The counter's next integer, never concatenated onto the old name."""
        if old.isdigit():
            self._version_counter = max(self._version_counter, int(old))
        self._version_counter += 1
        return str(self._version_counter)

    def _break_weights(self, message: str) -> None:
        self.weights_broken = message
        logger.error(message)
        self.abort_all(message)

    def _per_rank(self, source: UpdateWeights) -> UpdateWeights | PerRank:
        """Tensors in the message go to each rank without the experts it does not hold (expert parallelism):
        nothing is pickled through a pipe to be dropped. A directory is read by each rank for its own
        tensors (worker/weight_updater.py); a broadcast and a serialized payload per rank are the trainer's
        to shape (docs/expert_parallel.md says why they are not split here)."""
        if source.tensors is None or self.placements is None:
            return source
        return PerRank([replace(source, tensors=[(n, t) for n, t in source.tensors if q.holds_checkpoint_tensor(n)])
                        for q in self.placements])

    def call_workers(self, msg: object) -> list:
        """Every rank's answer to a control message; the engine heartbeats while they work."""
        return self.workers.call(msg, timeout=_WEIGHT_CALL_TIMEOUT_S, while_waiting=self.heartbeat)

    @staticmethod
    def _raise_on_errors(results: list[WeightUpdateResult], what: str) -> None:
        errors = [f"rank {r.rank}: {r.error}" for r in results if r.error]
        if errors:
            raise EngineControlError(f"{what} failed: {'; '.join(errors)}")
