"""What a Hugging Face checkpoint's config.json and generation_config.json say, whichever
`transformers` version wrote them.

The three families are written under different key names by different transformers versions, and
transformers itself reads them through aliases and class defaults. `normalize_hf_config` gives the
engine one name per fact, the names below, so that model code never guesses:

    fact                    canonical key                 also written as
    routed expert count     num_experts                   num_local_experts (Mixtral; Qwen3-MoE by
                                                          transformers v5), n_routed_experts (GLM)
    GLM draft (MTP) layers  num_nextn_predict_layers      num_mtp_layers
    RoPE                    rope_parameters {rope_type,   rope_theta / rope_scaling {type|rope_type}
                            rope_theta[, partial_rotary_  / partial_rotary_factor at top level (v4)
                            factor]}
    weights dtype           dtype                         torch_dtype (v4)
    head size               head_dim                      absent or null: hidden_size // heads
    kv heads                num_key_value_heads           absent or null: num_attention_heads

Keys a config leaves out take the default of the installed transformers' config class for that
family (tests/test_hf_config.py checks the table against it), so a hand-written config means what it
means to transformers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from fastdeploy_r3.errors import ConfigError

# architecture name in config.json -> model family module under model_executor/models
SUPPORTED_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Glm4MoeForCausalLM": "glm4_moe",
}

# the installed transformers' defaults (Qwen3MoeConfig, MixtralConfig, Glm4MoeConfig) of every key the
# engine reads; rope defaults live in ROPE_DEFAULTS
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
        "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
        "use_sliding_window": False,
    },
    "mixtral": {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False},
    "glm4_moe": {
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
        "n_shared_experts": 1, "norm_topk_prob": True, "use_qk_norm": False, "attention_bias": False,
        "num_nextn_predict_layers": 1,
    },
}
ROPE_DEFAULTS: dict[str, dict[str, float]] = {
    "qwen3_moe": {"rope_theta": 10000.0},
    "mixtral": {"rope_theta": 1000000.0},
    "glm4_moe": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}
# canonical key <- the other names transformers versions write it under
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_experts": ("num_local_experts", "n_routed_experts"),
    "num_nextn_predict_layers": ("num_mtp_layers",),
    "dtype": ("torch_dtype",),
}
_REQUIRED_KEYS = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads")
# generation_config.json field -> the SamplingParams field it is the default of (vLLM's list less min_p,
# which SamplingParams lacks); max_new_tokens caps the engine's own max_tokens default, as in vLLM
GENERATION_DEFAULT_KEYS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def architecture_of(hf: dict[str, Any]) -> str:
    """config.json's `architectures[0]`, which must be one this engine serves."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"unknown architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def normalize_hf_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A copy of config.json with one canonical key per fact (module docstring) and the family's
    defaults filled in; idempotent. Alias keys that disagree with each other are an error."""
    family = SUPPORTED_ARCHITECTURES[architecture_of(raw)]
    for key in _REQUIRED_KEYS:
        if raw.get(key) is None:
            raise ConfigError(f"config.json lacks {key!r}; the checkpoint config is malformed")
    hf = dict(raw)
    for canonical, aliases in _ALIASES.items():
        names = [k for k in (canonical, *aliases) if hf.get(k) is not None]
        if len({json.dumps(hf[k]) for k in names}) > 1:
            raise ConfigError(
                "config.json gives one fact different values under " + ", ".join(f"{k}={hf[k]!r}" for k in names)
                + "; keep one of these keys"
            )
        value = hf[names[0]] if names else None
        for k in aliases:
            hf.pop(k, None)
        hf[canonical] = value
    hf["rope_parameters"] = _rope_parameters(hf, family)
    for key in ("rope_theta", "rope_scaling", "partial_rotary_factor"):
        hf.pop(key, None)
    for key, default in FAMILY_DEFAULTS[family].items():
        if hf.get(key) is None:
            hf[key] = list(default) if isinstance(default, list) else default
    if hf.get("num_key_value_heads") is None:
        hf["num_key_value_heads"] = hf["num_attention_heads"]
    if hf.get("head_dim") is None:
        hf["head_dim"] = int(hf["hidden_size"]) // int(hf["num_attention_heads"])
    return hf


def _rope_parameters(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """transformers v5's rope_parameters; a v4 config's top-level rope_theta / rope_scaling /
    partial_rotary_factor folded in the way v5 folds them when it reads one."""
    rp = dict(hf.get("rope_parameters") or {})
    if not rp:
        rp = dict(hf.get("rope_scaling") or {})
        if "type" in rp:  # the oldest spelling of rope_type
            rp.setdefault("rope_type", rp.pop("type"))
    rp.setdefault("rope_type", "default")
    for key, default in ROPE_DEFAULTS[family].items():
        if rp.get(key) is None:
            rp[key] = float(hf[key]) if hf.get(key) is not None else default
    return rp


def num_routed_experts_from_hf_config(hf: dict[str, Any]) -> int:
    """The routed expert count (0 for a model without routed experts)."""
    return int(normalize_hf_config(hf)["num_experts"] or 0)


def moe_layer_ids_from_hf_config(hf: dict[str, Any]) -> list[int]:
    """The explicit list of MoE layer indices of a checkpoint: dense layers are not counted, nor
    GLM's draft (MTP) layers, which follow the num_hidden_layers decoder layers."""
    c = normalize_hf_config(hf)
    n = int(c["num_hidden_layers"])
    if int(c["num_experts"] or 0) <= 0:
        return []
    family = SUPPORTED_ARCHITECTURES[architecture_of(c)]
    if family == "qwen3_moe":
        step = int(c["decoder_sparse_step"])
        if step < 1:
            raise ConfigError(f"decoder_sparse_step={step} in config.json; use 1 or more")
        mlp_only = {int(i) for i in c["mlp_only_layers"]}
        return [i for i in range(n) if i not in mlp_only and (i + 1) % step == 0]
    if family == "mixtral":
        return list(range(n))
    return list(range(int(c["first_k_dense_replace"]), n))


def checkpoint_dtype(hf: dict[str, Any]) -> str | None:
    """The dtype the checkpoint's weights were saved in (`dtype`, or v4's `torch_dtype`), e.g. 'bfloat16'."""
    value = normalize_hf_config(hf)["dtype"]
    return None if value is None else str(value).removeprefix("torch.")


def read_hf_config(model_dir: str) -> dict[str, Any]:
    """config.json of `model_dir`, validated and normalized."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{model_dir!r} has no config.json; it is not a Hugging Face-format model directory")
    raw = _read_json_object(path)
    try:
        return normalize_hf_config(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e


def token_ids(value: Any) -> list[int]:
    """An `eos_token_id`-style field (null, an id, or a list of ids) as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json as vLLM applies it: its eos ids stop generation (besides config.json's
    and the tokenizer's), and its sampling fields are the defaults of requests that leave them unset."""

    eos_token_ids: list[int] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams field names -> defaults

    @classmethod
    def read(cls, model_dir: str) -> GenerationDefaults:
        """From `model_dir`/generation_config.json; an absent file means no defaults."""
        path = os.path.join(model_dir, "generation_config.json")
        if not os.path.isfile(path):
            return cls()
        gen = _read_json_object(path)
        sampling = {ours: gen[k] for k, ours in GENERATION_DEFAULT_KEYS.items() if gen.get(k) is not None}
        return cls(token_ids(gen.get("eos_token_id")), sampling)


def _read_json_object(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); fix or regenerate the checkpoint") from e
    if not isinstance(obj, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return obj
