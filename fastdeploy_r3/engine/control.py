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
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastdeploy_r3.cache_manager.block_hash import root_hash
from fastdeploy_r3.engine.request import WeightVersionEvent
from fastdeploy_r3.worker.messages import (
    DestroyWeightUpdateGroup,
    InitWeightUpdateGroup,
    UpdateWeights,
    WeightUpdateResult,
)

if TYPE_CHECKING:
    from fastdeploy_r3.engine.engine_service import EngineService

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


class EngineControl:
    def __init__(self, svc: EngineService) -> None:
        self.svc = svc
        self.paused: str | None = None  # the pause mode while /pause_generation holds the engine
        self.weights_broken: str | None = None
        self.num_weight_updates = 0

    # -- pause --------------------------------------------------------------------------------------

    def pause(self, mode: str) -> int:
        """Stop advancing requests; mode 'abort' also aborts every request in flight. Returns how many
        requests were aborted or are held."""
        if mode not in PAUSE_MODES:
            raise EngineControlError(f"pause mode {mode!r} is not supported; use one of {', '.join(PAUSE_MODES)}")
        n = len(self.svc.request_ids())
        if mode == "abort":
            self.abort_all("aborted by /pause_generation (mode 'abort')")
        self.paused = mode
        return n

    def resume(self) -> None:
        self.paused = None

    def abort_all(self, message: str) -> None:
        for request_id in self.svc.request_ids():
            self.svc.abort_request(request_id, message)

    def flush_cache(self) -> int:
        return self.svc.kv.flush()

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
        old = self.svc.weight_version
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
        svc = self.svc
        for req in svc.unfinished_requests():
            req.weight_version_events.append(
                WeightVersionEvent(old, len(req.output_token_ids), req.num_computed_tokens)
            )
            req.weight_version = new
        svc.weight_version = new
        svc.kv.reset_root(root_hash(svc.config.model_config.model_identity, new))
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
        assert self.svc.workers is not None
        return self.svc.workers.call(msg, timeout=_WEIGHT_CALL_TIMEOUT_S)

    @staticmethod
    def _raise_on_errors(results: list[WeightUpdateResult], what: str) -> None:
        errors = [f"rank {r.rank}: {r.error}" for r in results if r.error]
        if errors:
            raise EngineControlError(f"{what} failed: {'; '.join(errors)}")
