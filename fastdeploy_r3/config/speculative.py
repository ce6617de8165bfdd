"""Speculative decoding settings: vLLM's `--speculative-config` JSON, and SGLang's flags mapped onto it.

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}

    SGLang                                             here
    --speculative-algorithm NGRAM                      method "ngram"
    --speculative-num-draft-tokens D                   num_speculative_tokens D - 1 (SGLang counts the
                                                       verified token its drafts follow among the D)
    --speculative-ngram-min-match-window-size a        prompt_lookup_min a
    --speculative-ngram-max-match-window-size b        prompt_lookup_max b

Only the n-gram drafter exists (engine/speculative.py); a method that needs a draft model ("mtp",
"eagle3") is refused with what to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from fastdeploy_r3.errors import ConfigError
from fastdeploy_r3.json_args import json_object_arg

METHODS = ("ngram",)
# methods other engines know that need a draft model: refused by name rather than as unknown
_NOT_BUILT = ("mtp", "eagle", "eagle3", "draft_model", "medusa")
# SGLang's --speculative-algorithm values and the method each is here
SGLANG_ALGORITHMS = {"NGRAM": "ngram"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3  # drafts verified per request per step (k)
    prompt_lookup_min: int = 1  # shortest suffix n-gram looked up in the request's tokens
    prompt_lookup_max: int = 4  # longest; tried first

    def __post_init__(self) -> None:
        if self.method in _NOT_BUILT:
            raise ConfigError(f"speculative method {self.method!r} needs a draft model, which this engine does not "
                              "load yet; use {\"method\": \"ngram\"}")
        if self.method not in METHODS:
            raise ConfigError(f"speculative method {self.method!r} is unknown; use one of {', '.join(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"speculative {name}={v!r}; use an integer >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative prompt_lookup_min={self.prompt_lookup_min} is above prompt_lookup_max="
                              f"{self.prompt_lookup_max}; the shortest n-gram cannot be longer than the longest")

    @classmethod
    def from_json(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A JSON object (text, a file path holding one, or a dict); None or {} is speculation off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = json_object_arg(value, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
        if not isinstance(value, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        if not value:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown speculative config key(s) {', '.join(unknown)}; known keys: "
                              f"{', '.join(sorted(known))}")
        if "method" not in value:
            raise ConfigError('--speculative-config needs "method" (e.g. "ngram")')
        return cls(**value)

    @classmethod
    def from_sglang(cls, algorithm: str, num_draft_tokens: int | None, min_window: int | None,
                    max_window: int | None) -> SpeculativeConfig:
        """SGLang's flags (the table above)."""
        method = SGLANG_ALGORITHMS.get(algorithm.upper())
        if method is None:
            raise ConfigError(f"--speculative-algorithm {algorithm!r} is not served here; use NGRAM")
        kw: dict[str, Any] = {"method": method}
        if num_draft_tokens is not None:
            if num_draft_tokens < 2:
                raise ConfigError(f"--speculative-num-draft-tokens {num_draft_tokens}: it counts the verified token "
                                  "the drafts follow, so use 2 or more (2 = one draft per step)")
            kw["num_speculative_tokens"] = num_draft_tokens - 1
        if min_window is not None:
            kw["prompt_lookup_min"] = min_window
        if max_window is not None:
            kw["prompt_lookup_max"] = max_window
        return cls(**kw)
