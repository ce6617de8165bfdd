"""Speculative decoding settings: vLLM's `--speculative-config` JSON, and SGLang's flags mapped onto it.

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}
    {"method": "mtp", "num_speculative_tokens": k}     GLM-4.5's own draft (MTP) layer

    SGLang                                             here
    --speculative-algorithm NGRAM                      method "ngram"
    --speculative-algorithm EAGLE | NEXTN              method "mtp" (SGLang serves GLM-4.5's draft layer so)
    --speculative-num-steps N                          num_speculative_tokens N (EAGLE / NEXTN)
    --speculative-eagle-topk 1                         (a chain; tree drafts are not served)
    --speculative-num-draft-tokens D                   num_speculative_tokens D - 1 (SGLang counts the
                                                       verified token its drafts follow among the D)
    --speculative-ngram-min-match-window-size a        prompt_lookup_min a
    --speculative-ngram-max-match-window-size b        prompt_lookup_max b

Drafters: n-gram prompt lookup (engine/speculative.py) and GLM-4.5's MTP layer (worker/mtp_drafter.py;
EngineConfig refuses it for a model without one); a method that needs a separate draft model ("eagle3")
is refused with what to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from fastdeploy_r3.errors import ConfigError
from fastdeploy_r3.json_args import json_object_arg

METHODS = ("ngram", "mtp")
# methods other engines know that need a separate draft model: refused by name rather than as unknown
_NOT_BUILT = ("eagle", "eagle3", "draft_model", "medusa")
# SGLang's --speculative-algorithm values and the method each is here
SGLANG_ALGORITHMS = {"NGRAM": "ngram", "EAGLE": "mtp", "NEXTN": "mtp"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3  # drafts verified per request per step (k)
    prompt_lookup_min: int = 1  # shortest suffix n-gram looked up in the request's tokens
    prompt_lookup_max: int = 4  # longest; tried first

    def __post_init__(self) -> None:
        if self.method in _NOT_BUILT:
            raise ConfigError(f"speculative method {self.method!r} needs a separate draft model, which this engine "
                              "does not load; use {\"method\": \"ngram\"}, or \"mtp\" for GLM-4.5's own draft layer")
        if self.method not in METHODS:
            raise ConfigError(f"speculative method {self.method!r} is unknown; use one of {', '.join(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"speculative {name}={v!r}; use an integer >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative prompt_lookup_min={self.prompt_lookup_min} is above prompt_lookup_max="
                              f"{self.prompt_lookup_max}; the shortest n-gram cannot be longer than the longest")

    def validate_for_model(self, model: str, hf_config: dict[str, Any], tensor_parallel_size: int) -> None:
        """MTP drafts need the checkpoint's own draft layer (GLM-4.5's num_nextn_predict_layers) and, today,
        one rank: the draft layer runs on rank 0 after the draw (worker/mtp_drafter.py)."""
        if self.method != "mtp":
            return
        arch = (hf_config.get("architectures") or ["?"])[0]
        if arch != "Glm4MoeForCausalLM" or int(hf_config.get("num_nextn_predict_layers") or 0) < 1:
            raise ConfigError(f'speculative method "mtp" needs a checkpoint with a draft (MTP) layer, and {model!r} '
                              f"({arch}) has none (GLM-4.5 checkpoints say num_nextn_predict_layers >= 1 in "
                              'config.json); use {"method": "ngram"}')
        if tensor_parallel_size != 1:
            raise ConfigError(f'speculative method "mtp" runs its draft layer on one rank; tensor_parallel_size='
                              f'{tensor_parallel_size} is not served with it yet: use 1, or {{"method": "ngram"}}')

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
                    max_window: int | None, num_steps: int | None = None,
                    eagle_topk: int | None = None) -> SpeculativeConfig:
        """SGLang's flags (the table above)."""
        method = SGLANG_ALGORITHMS.get(algorithm.upper())
        if method is None:
            raise ConfigError(f"--speculative-algorithm {algorithm!r} is not served here; use NGRAM, or EAGLE / "
                              "NEXTN for GLM-4.5's draft (MTP) layer")
        if method == "mtp" and (min_window is not None or max_window is not None):
            raise ConfigError("--speculative-ngram-* flags are for --speculative-algorithm NGRAM, not "
                              f"{algorithm.upper()}")
        if method == "ngram" and (num_steps is not None or eagle_topk is not None):
            raise ConfigError("--speculative-num-steps / --speculative-eagle-topk are for EAGLE / NEXTN, not NGRAM")
        if eagle_topk not in (None, 1):
            raise ConfigError(f"--speculative-eagle-topk {eagle_topk}: only chains of drafts (1) are served here")
        if num_steps is not None and num_draft_tokens is not None and num_draft_tokens != num_steps + 1:
            raise ConfigError(f"--speculative-num-draft-tokens {num_draft_tokens} with --speculative-num-steps "
                              f"{num_steps}: a chain verifies num-steps + 1 tokens, so give {num_steps + 1}")
        if num_steps is not None:
            num_draft_tokens = num_steps + 1
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
