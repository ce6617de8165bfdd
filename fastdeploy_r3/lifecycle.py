"""Process life-cycle words that every process boundary shares (server, engine, workers).

`Shutdown` is the one "finish what you hold and exit" message; `EngineDeadError` the one error for
"the engine, or a child it needs, is gone" (raised in the engine when a worker or the cache transfer
manager dies, and in the API server when the engine process does).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Shutdown:
    """Sent to a child process: release what you hold (shared memory, process groups) and exit."""


class EngineDeadError(RuntimeError):
    """The engine or one of its child processes died; in-flight requests were failed. Restart it."""
