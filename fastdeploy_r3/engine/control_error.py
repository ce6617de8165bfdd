"""The errors of the control plane (control.py, memory_control.py), in a module of their own so that
both raise them without importing each other, and the engine process maps them without importing either."""

from __future__ import annotations


class EngineControlError(RuntimeError):
    """A control command was refused or failed; the message says why and what to do.

    invalid: the command itself was wrong (HTTP 400); otherwise carrying it out failed (HTTP 500)."""

    def __init__(self, message: str, invalid: bool = True, status: int | None = None) -> None:
        super().__init__(message)
        self.invalid = invalid
        self.status = status  # 409: the engine's state forbids it now (requests in flight, memory released)


class WeightVersionError(RuntimeError):
    """A request names the weight version it must run on (a decode server's request, computed by its prefill
    server with those weights), and this engine holds another: refused before it is queued."""
