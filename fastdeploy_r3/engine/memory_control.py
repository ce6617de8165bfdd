"""Release and resume the engine's memory for colocated training (SGLang's /release_memory_occupation
and /resume_memory_occupation), as one state machine over the tags `kv_cache` and `weights`:

    serving ──release(tags)──► released ⊆ {kv_cache, weights} ──resume(tags)──► ... ──► serving
                                  │ new requests: 503 "memory released; resume"
                                  │ weight updates: refused while the weights are released
    resume(weights) without new weights: the model holds zeros; requests are refused (503) until a
    weight update (tensor, disk or distributed) fills it — nothing of the released weights was kept

Release needs an idle engine (no request in flight, 409 otherwise: pause with mode "abort" or wait),
since every request's KV lives in the cache being freed, and a CPU or storage tier (the cache
transfer manager maps the KV cache) keeps the cache pinned (400). A resumed KV cache is empty, so
the prefix cache forgets every block.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastdeploy_r3.engine.control_error import EngineControlError
from fastdeploy_r3.engine.messages import MemoryReport
from fastdeploy_r3.worker.messages import MEMORY_TAGS, MemoryResult, ReleaseMemory, ResumeMemory

if TYPE_CHECKING:
    from fastdeploy_r3.engine.control import EngineControl

logger = logging.getLogger(__name__)


class MemoryControl:
    def __init__(self, control: EngineControl) -> None:
        self.control = control
        self.released: set[str] = set()
        self.weights_missing = False  # resumed without contents: an update must fill them

    @staticmethod
    def tags_of(tags: list[str] | None) -> list[str]:
        """SGLang's rule: no tags means all of them."""
        if tags is None:
            return list(MEMORY_TAGS)
        unknown = sorted(set(tags) - set(MEMORY_TAGS))
        if unknown:
            raise EngineControlError(f"memory tag(s) {unknown} unknown; use {list(MEMORY_TAGS)} (or null for both)")
        return [t for t in MEMORY_TAGS if t in tags]

    def unavailable(self) -> str | None:
        """Why requests cannot be served now, or None."""
        if self.released:
            return (f"memory is released ({', '.join(sorted(self.released))}); call /resume_memory_occupation "
                    "before sending requests")
        if self.weights_missing:
            return ("the weights were released and resumed without new values; push weights "
                    "(/update_weights_from_tensor, _from_disk or _from_distributed) before sending requests")
        return None

    def release(self, tags: list[str] | None) -> tuple[str, MemoryReport]:
        wanted = self.tags_of(tags)
        busy = len(self.control.requests.request_ids())
        if busy:
            raise EngineControlError(
                f"{busy} requests are in flight and hold KV cache; pause with mode 'abort' (or wait for them) "
                "before releasing memory", status=409)
        if self.control.has_kv_tiers:
            raise EngineControlError(
                "releasing memory is not supported with a CPU or storage KV tier (the cache transfer manager "
                "maps the KV cache); start the engine without swap_space / kv_storage for colocated training")
        todo = [t for t in wanted if t not in self.released]
        results = self._call(ReleaseMemory(todo)) if todo else []
        self.released.update(todo)
        if "kv_cache" in todo:
            self.control.cache.flush()  # the blocks' contents are gone with the memory
        freed = sum(r.nbytes for r in results)
        return f"released {', '.join(wanted)}: {freed / 2**20:.1f} MiB freed", _report(results)

    def resume(self, tags: list[str] | None) -> tuple[str, MemoryReport]:
        wanted = self.tags_of(tags)
        todo = [t for t in wanted if t in self.released]
        results = self._call(ResumeMemory(todo)) if todo else []
        self.released.difference_update(todo)
        if "weights" in todo:
            self.weights_missing = True
        if "kv_cache" in todo:
            self.control.cache.flush()
        allocated = sum(r.nbytes for r in results)
        note = "; the weights hold no values until a weight update" if self.weights_missing else ""
        return f"resumed {', '.join(wanted)}: {allocated / 2**20:.1f} MiB allocated{note}", _report(results)

    def weights_filled(self) -> None:
        """A weight update succeeded: resumed weights hold values again."""
        self.weights_missing = False

    def _call(self, msg: ReleaseMemory | ResumeMemory) -> list[MemoryResult]:
        results: list[MemoryResult] = self.control.call_workers(msg)
        errors = [r.error for r in results if r.error]
        if errors:
            raise EngineControlError(f"{type(msg).__name__} failed: {'; '.join(errors)}", invalid=False)
        return results


def _report(results: list[MemoryResult]) -> MemoryReport:
    return MemoryReport([r.nbytes for r in results], [r.allocated_before for r in results],
                        [r.allocated_after for r in results])
