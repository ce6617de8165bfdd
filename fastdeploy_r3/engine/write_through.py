"""AwaitWriteThrough answered from the engine loop, a step at a time, instead of blocking it.

A prefill server publishes a request's handoff only once the request's full blocks are in the shared
store (entrypoints/pd/roles.py). Blocking the loop until then stalled every other request once per
handoff, for as long as the store took. Instead the loop notes which saves were in flight when the
command arrived and answers it once none of those is left (stored, failed, or abandoned with a lost
cache transfer manager); saves submitted later do not delay it. Meanwhile the loop steps and answers
as usual. The engine's own health checks keep their deadlines: a store that never answers fails its
saves after --storage-timeout-s (the cache transfer manager's call deadline), and a lost transfer
manager abandons them.
"""

from __future__ import annotations

from typing import Protocol


class SaveTracker(Protocol):
    def poll_transfers(self, block: bool = False) -> None: ...

    def saves_in_flight(self) -> frozenset[tuple[int, int]]: ...


class WriteThroughWaits:
    """The write-through waits of one engine: query ids, each with the saves it waits out."""

    def __init__(self) -> None:
        self._waits: list[tuple[int, frozenset[tuple[int, int]]]] = []

    def add(self, query_id: int, kv: SaveTracker) -> None:
        self._waits.append((query_id, kv.saves_in_flight()))

    def pending(self) -> bool:
        return bool(self._waits)

    def ready(self, kv: SaveTracker) -> list[int]:
        """Query ids whose saves are all done now (polling the transfers first), in arrival order."""
        if not self._waits:
            return []
        kv.poll_transfers()
        left = kv.saves_in_flight()
        done = [q for q, saves in self._waits if not saves & left]
        self._waits = [(q, saves) for q, saves in self._waits if saves & left]
        return done
