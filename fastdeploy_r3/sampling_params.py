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
    penalties    repetition_penalty in [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY] (a logit
                 divided by 1e-300 is inf, and inf - inf is NaN), presence / frequency in [-2, 2]
    stop         at most MAX_STOP_STRINGS strings of MAX_STOP_CHARS characters in all, and at most
                 MAX_STOP_TOKEN_IDS stop_token_ids: the stop check runs in the engine loop, once per
                 token of every running request, so one request's list must not slow its neighbours
    token ids    stop_token_ids are ints (not bools) in [0, vocab): `check_vocab` once the model is known
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from fastdeploy_r3.logprobs import MAX_LOGPROBS

MIN_TEMPERATURE = 1e-5  # below this, greedy (vLLM's _SAMPLING_EPS)
SEED_MODULUS = 2**64
MIN_SEED = -(2**63)
# logits / temperature stays finite in float32 (and -inf / T stays -inf, never NaN) up to this
MAX_TEMPERATURE = 1e4
MIN_REPETITION_PENALTY = 1e-2
MAX_REPETITION_PENALTY = 1e2
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 8192
MAX_STOP_TOKEN_IDS = 1024


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
    # passed to the tokenizer's decode, as SGLang and vLLM do (slow tokenizers read it, fast ones join
    # special tokens the same way either way)
    spaces_between_special_tokens: bool = True
    # per sampled token, also the entropy of the distribution it was drawn from (TokenLogprob.entropy)
    # and the ids its top-k / top-p truncation kept (TokenLogprob.kept_ids; the logprob is then
    # renormalised over them): SGLang's return_entropy and slime's custom_params.return_top_p_token_ids
    return_entropy: bool = False
    return_top_p_token_ids: bool = False
    # R3, per request: None = the server's default (on when R3 is enabled)
    return_routed_experts: bool | None = None
    routed_experts_start: int = 0
    routing_layout: str | None = None  # "moe" | "all_layers"; None = the server's routing_layout

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("n", "max_tokens", "top_k", "min_tokens"):
            value = getattr(self, name)
            if not _is_int(value):
                raise InvalidRequestError(f"{name}={value!r}; use an integer")
            setattr(self, name, int(value))  # numpy ints too, as plain ints for the wire
        if self.n < 1:
            raise InvalidRequestError(f"n={self.n}; use n >= 1")
        if self.max_tokens is None or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens={self.max_tokens}; use max_tokens >= 1")
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequestError(
                f"temperature={self.temperature}; use a temperature in [0, {MAX_TEMPERATURE:g}] (below "
                f"{MIN_TEMPERATURE:g} is greedy)"
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
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or sum(len(s) for s in self.stop) > MAX_STOP_CHARS:
            raise InvalidRequestError(
                f"stop has {len(self.stop)} strings of {sum(len(s) for s in self.stop)} characters in all; send "
                f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters together"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"stop_token_ids has {len(self.stop_token_ids)} ids; send at most {MAX_STOP_TOKEN_IDS}"
            )
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids={self.stop_token_ids[:8]!r}...; token ids are integers >= 0")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.routing_layout not in (None, "moe", "all_layers"):
            raise InvalidRequestError(f"routing_layout={self.routing_layout!r}; use 'moe' or 'all_layers'")
        if self.routed_experts_start < 0:
            raise InvalidRequestError(f"routed_experts_start={self.routed_experts_start}; use a row index >= 0")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens={self.min_tokens}; use a value in [0, max_tokens={self.max_tokens}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name}={getattr(self, name)}; use a value in [-2, 2]")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(
                f"repetition_penalty={self.repetition_penalty}; use a value in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}] (1 is off)"
            )
        if self.return_top_p_token_ids and not self.greedy and self.top_k <= 0 and self.top_p >= 1.0:
            raise InvalidRequestError(
                "return_top_p_token_ids needs a truncation to report: set top_p < 1 or top_k >= 1 (without one "
                "the kept ids are the whole vocabulary at every token)"
            )
        if (self.return_entropy or self.return_top_p_token_ids) and self.logprobs is None:
            self.logprobs = 0  # the extras ride on the sampled token's logprob record
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name}={value}; use a value in [0, {MAX_LOGPROBS}] or leave it unset")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the request names must exist: a stop id past the vocabulary would index out of
        the logits in the worker's min_tokens mask (a step that raises) or silently never match."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice `index` when one request asks for n > 1 choices."""
        return None if self.seed is None else (self.seed + index) % SEED_MODULUS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _is_int(value: object) -> bool:
    """An integer (Python's or numpy's), and not a bool: True is not a token count."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
