"""Per-request sampling parameters, validated on construction (at the package top, as vLLM keeps them,
so that engine, worker and server all import them without importing each other)."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request cannot be served as given; the message says what to change."""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # R3, per request: None = the server's default (on when R3 is enabled)
    return_routed_experts: bool | None = None
    routed_experts_start: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.n < 1:
            raise InvalidRequestError(f"n={self.n}; use n >= 1")
        if self.max_tokens is None or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens={self.max_tokens}; use max_tokens >= 1")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature={self.temperature}; use temperature >= 0 (0 is greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p={self.top_p}; use a value in (0, 1]")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k={self.top_k}; use -1 or 0 (disabled) or a positive k")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if self.routed_experts_start < 0:
            raise InvalidRequestError(f"routed_experts_start={self.routed_experts_start}; use a row index >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
