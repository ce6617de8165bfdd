"""The engine's RL control plane: pause / continue, flush, and weight updates with version isolation
(DESIGN.md §5.7, SGLang's control endpoints).

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
aborted with that message, and new ones are refused until an update succeeds.

EngineControl sees the engine through three narrow collaborators (the Protocols below), so it never
imports the loop that owns it: the requests in flight, the prefix cache it flushes and re-roots, and
the workers it calls. It owns the runtime state the commands change: the pause mode, the current
weight version and whether the weights are usable.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from fastdeploy_r3.cache_manager.block_hash import root_hash
from fastdeploy_r3.engine.request import Request, WeightVersionEvent
from fastdeploy_r3.worker.messages import (
    DestroyWeightUpdateGroup,
    InitWeightUpdateGroup,
    UpdateWeights,
    WeightUpdateResult,
)

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "in_place")
# a rendezvous waits for the trainer; a broadcast of a large model takes a while
_WEIGHT_CALL_TIMEOUT_S = 3600.0


class EngineControlError(RuntimeError):
    """A control command was refused or failed; the message says why and what to do.

    invalid: the command itself was wrong (HTTP 400); otherwise carrying it out failed (HTTP 500)."""

    def __init__(self, message: str, invalid: bool = True) -> None:
        super().__init__(message)
        self.invalid = invalid


class ControlledRequests(Protocol):
    """The requests in flight, as the control plane sees them (EngineService)."""

    def request_ids(self) -> list[str]: ...

    def abort_request(self, request_id: str, message: str | None = None) -> None: ...

    def unfinished_requests(self) -> list[Request]: ...


class ControlledCache(Protocol):
    """The prefix cache: flushed by /flush_cache, re-rooted by a new weight version (PrefixCacheManager)."""

    def flush(self) -> int: ...

    def reset_root(self, root_hash: bytes) -> None: ...


class ControlledWorkers(Protocol):
    """Every worker rank, one answer each in rank order (WorkerGroup)."""

    def call(self, msg: object, timeout: float | None = None) -> list[Any]: ...


class EngineControl:
    def __init__(
        self,
        requests: ControlledRequests,
        cache: ControlledCache,
        workers: ControlledWorkers,
        model_identity: str,
        weight_version: str,
    ) -> None:
        self.requests = requests
        self.cache = cache
        self.workers = workers
        self.model_identity = model_identity
        self.weight_version = weight_version  # roots the prefix cache; changed by update_weights only
        self.paused: str | None = None  # the pause mode while /pause_generation holds the engine
        self.weights_broken: str | None = None
        self.num_weight_updates = 0

    # -- pause --------------------------------------------------------------------------------------

    def pause(self, mode: str) -> int:
        """Stop advancing requests; mode 'abort' also aborts every request in flight. Returns how many
        requests were aborted or are held."""
        if mode not in PAUSE_MODES:
            raise EngineControlError(f"pause mode {mode!r} is not supported; use one of {', '.join(PAUSE_MODES)}")
        n = len(self.requests.request_ids())
        if mode == "abort":
            self.abort_all("aborted by /pause_generation (mode 'abort')")
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
        self._raise_on_errors(self._call_workers(cmd), f"joining weight update group {cmd.group_name!r}")

    def destroy_weight_update_group(self, cmd: DestroyWeightUpdateGroup) -> None:
        self._raise_on_errors(self._call_workers(cmd), f"leaving weight update group {cmd.group_name!r}")

    # -- weight updates -----------------------------------------------------------------------------

    def update_weights(self, source: UpdateWeights, weight_version: str | None, abort_all_requests: bool) -> str:
        """Load new weights on every rank and make weight_version (default: the next one) current.

        The prefix caches are always flushed (SGLang's flush_cache=False has no meaning here: entries of
        the old version could never be hit again, so keeping them would only hold blocks)."""
        old = self.weight_version
        new = self._next_version(old) if weight_version is None else weight_version
        if new == old:
            raise EngineControlError(
                f"weight_version {new!r} is the current version; pass a new one: it roots the prefix cache, "
                "so reusing it would serve KV and R3 of the old weights"
            )
        if not new or len(new) > 128:
            raise EngineControlError(f"weight_version {new!r}: use 1-128 characters")
        if abort_all_requests:
            self.abort_all("aborted for a weight update (abort_all_requests)")
        results = self._call_workers(source)
        changed = any(r.weights_changed or (r.error is None and r.num_tensors) for r in results)
        errors = [r.error for r in results if r.error]
        if errors:
            if changed:
                self._break_weights(f"a weight update failed half way and left old and new weights mixed: {errors[0]}")
            raise EngineControlError(errors[0], invalid=not changed)
        self._advance_version(old, new)
        return new

    def check_weights_usable(self) -> None:
        if self.weights_broken is not None:
            raise EngineControlError(f"{self.weights_broken}; push a complete update before sending requests",
                                     invalid=False)

    # -- internals ----------------------------------------------------------------------------------

    def _advance_version(self, old: str, new: str) -> None:
        for req in self.requests.unfinished_requests():
            req.weight_version_events.append(
                WeightVersionEvent(old, len(req.output_token_ids), req.num_computed_tokens)
            )
            req.weight_version = new
        self.weight_version = new
        self.cache.reset_root(root_hash(self.model_identity, new))
        self.weights_broken = None
        self.num_weight_updates += 1
        logger.info("weight version %s -> %s", old, new)

    def _next_version(self, old: str) -> str:
        return str(int(old) + 1) if old.isdigit() else f"{old}+{self.num_weight_updates + 1}"

    def _break_weights(self, message: str) -> None:
        self.weights_broken = message
        logger.error(message)
        self.abort_all(message)

    def _call_workers(self, msg: object) -> list[WeightUpdateResult]:
        return self.workers.call(msg, timeout=_WEIGHT_CALL_TIMEOUT_S)

    @staticmethod
    def _raise_on_errors(results: list[WeightUpdateResult], what: str) -> None:
        errors = [f"rank {r.rank}: {r.error}" for r in results if r.error]
        if errors:
            raise EngineControlError(f"{what} failed: {'; '.join(errors)}")
