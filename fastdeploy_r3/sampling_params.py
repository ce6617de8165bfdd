"""Per-request sampling parameters, validated on construction (at the package top, as vLLM keeps them,
so that engine, worker and server all import them without importing each other).

Validation admits only what the sampler can run, so that no request can make a step raise
(issue 11, F1):

    temperature  finite, >= 0; below MIN_TEMPERATURE it samples greedily (dividing logits by a
                 temperature like 1e-300 overflows to inf and the softmax to NaN), as vLLM does
    seed         an integer in [-2**63, 2**64), reduced to 64 bits (seed mod 2**64, so -1 is
                 2**64 - 1); the sampler's noise is keyed by those 64 bits and the token's
                 position; choice i of an n > 1 request uses (seed + i) mod 2**64
    top_p        in (0, 1]; NaN is refused (it fails every comparison)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fastdeploy_r3.logprobs import MAX_LOGPROBS

MIN_TEMPERATURE = 1e-5  # below this, greedy (vLLM's _SAMPLING_EPS)
SEED_MODULUS = 2**64
MIN_SEED = -(2**63)


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
    min_tokens: int = 0  # stop tokens, EOS and stop strings do not end a completion shorter than this
    # penalties, as vLLM defines them (worker/sample/penalties.py): off at 0, 0 and 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # logprobs (definition in fastdeploy_r3/logprobs.py): None = none; N = the chosen token's logprob
    # plus the N most likely alternatives (0: the chosen token's only)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # R3, per request: None = the server's default (on when R3 is enabled)
    return_routed_experts: bool | None = None
    routed_experts_start: int = 0
    routing_layout: str | None = None  # "moe" | "all_layers"; None = the server's routing_layout

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.n < 1:
            raise InvalidRequestError(f"n={self.n}; use n >= 1")
        if self.max_tokens is None or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens={self.max_tokens}; use max_tokens >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                f"temperature={self.temperature}; use a finite temperature >= 0 (below {MIN_TEMPERATURE:g} is greedy)"
            )
        if self.seed is not None:
            is_int = isinstance(self.seed, int) and not isinstance(self.seed, bool)
            if not is_int or not MIN_SEED <= self.seed < SEED_MODULUS:
                raise InvalidRequestError(f"seed={self.seed}; use an integer in [-2**63, 2**64) (seeds are 64-bit)")
            self.seed %= SEED_MODULUS
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p={self.top_p}; use a value in (0, 1]")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k={self.top_k}; use -1 or 0 (disabled) or a positive k")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if self.routing_layout not in (None, "moe", "all_layers"):
            raise InvalidRequestError(f"routing_layout={self.routing_layout!r}; use 'moe' or 'all_layers'")
        if self.routed_experts_start < 0:
            raise InvalidRequestError(f"routed_experts_start={self.routed_experts_start}; use a row index >= 0")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens={self.min_tokens}; use a value in [0, max_tokens={self.max_tokens}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name}={getattr(self, name)}; use a value in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise InvalidRequestError(f"repetition_penalty={self.repetition_penalty}; use a value > 0 (1 is off)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name}={value}; use a value in [0, {MAX_LOGPROBS}] or leave it unset")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice `index` when one request asks for n > 1 choices."""
        return None if self.seed is None else (self.seed + index) % SEED_MODULUS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
