"""The one error of the control plane (control.py, memory_control.py), in a module of its own so that
both raise it without importing each other."""

from __future__ import annotations


class EngineControlError(RuntimeError):
    """A control command was refused or failed; the message says why and what to do.

    invalid: the command itself was wrong (HTTP 400); otherwise carrying it out failed (HTTP 500)."""

    def __init__(self, message: str, invalid: bool = True, status: int | None = None) -> None:
        super().__init__(message)
        self.invalid = invalid
        self.status = status  # 409: the engine's state forbids it now (requests in flight, memory released)
