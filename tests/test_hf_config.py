"""hf_config: one canonical key per fact whichever transformers version wrote config.json, the installed
transformers' family defaults for keys a config leaves out, and generation_config.json's defaults."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from fastdeploy_r3.config import ConfigError, ModelConfig
from fastdeploy_r3.config.hf_config import (
    FAMILY_DEFAULTS,
    ROPE_DEFAULTS,
    GenerationDefaults,
    moe_layer_ids_from_hf_config,
    normalize_hf_config,
)
from fastdeploy_r3.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

CONFIG_CLASSES = {
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "mixtral": transformers.MixtralConfig,
    "glm4_moe": transformers.Glm4MoeConfig,
}
SHAPE = {"vocab_size": 64, "hidden_size": 16, "num_attention_heads": 2, "num_experts_per_tok": 2}

# the same Qwen3-MoE as transformers 4.x wrote it and as 5.x writes it
QWEN3_V4 = {
    "architectures": ["Qwen3MoeForCausalLM"], **SHAPE, "num_hidden_layers": 4, "num_experts": 8,
    "rope_theta": 1000000.0, "rope_scaling": None, "torch_dtype": "bfloat16", "head_dim": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [0],
}
QWEN3_V5 = {
    "architectures": ["Qwen3MoeForCausalLM"], **SHAPE, "num_hidden_layers": 4, "num_local_experts": 8,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "dtype": "bfloat16", "head_dim": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [0],
}


@pytest.mark.parametrize("family", sorted(CONFIG_CLASSES))
def test_family_defaults_are_the_installed_transformers_defaults(family: str) -> None:
    config = CONFIG_CLASSES[family]()
    assert {k: getattr(config, k) for k in FAMILY_DEFAULTS[family]} == FAMILY_DEFAULTS[family]
    rope = config.rope_parameters
    assert {k: rope[k] for k in ROPE_DEFAULTS[family]} == ROPE_DEFAULTS[family]


def test_v4_and_v5_spellings_mean_the_same_model() -> None:
    v4, v5 = normalize_hf_config(QWEN3_V4), normalize_hf_config(QWEN3_V5)
    assert v4 == v5
    assert v5["num_experts"] == 8 and "num_local_experts" not in v5
    assert v5["rope_parameters"] == {"rope_theta": 1000000.0, "rope_type": "default"}
    assert v5["dtype"] == "bfloat16" and "torch_dtype" not in v5
    assert moe_layer_ids_from_hf_config(QWEN3_V4) == moe_layer_ids_from_hf_config(QWEN3_V5) == [1, 2, 3]
    assert normalize_hf_config(v5) == v5  # idempotent


def test_v4_glm_top_level_rope_settings_fold_into_rope_parameters() -> None:
    glm = {"architectures": ["Glm4MoeForCausalLM"], **SHAPE, "num_hidden_layers": 3, "n_routed_experts": 4,
           "rope_theta": 500.0, "partial_rotary_factor": 0.25, "num_mtp_layers": 1}
    c = normalize_hf_config(glm)
    assert c["rope_parameters"] == {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}
    assert c["num_nextn_predict_layers"] == 1 and "num_mtp_layers" not in c
    assert c["head_dim"] == 8 and c["num_key_value_heads"] == 2  # hidden_size // heads, heads


def test_scaled_rope_is_kept_and_refused_by_the_model() -> None:
    """rope_scaling {type: yarn} (v4) becomes rope_parameters {rope_type: yarn}: not served as plain RoPE."""
    cfg = {**QWEN3_V4, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    assert normalize_hf_config(cfg)["rope_parameters"] == {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    with pytest.raises(NotImplementedError, match="rope_type 'yarn' is not supported"):
        Qwen3MoeForCausalLM(cfg, torch.float32)


def test_aliases_that_disagree_are_an_error() -> None:
    with pytest.raises(ConfigError, match="num_experts=8, num_local_experts=16; keep one of these keys"):
        normalize_hf_config({**QWEN3_V4, "num_local_experts": 16})


def test_omitted_keys_mean_what_they_mean_to_transformers() -> None:
    """GLM without first_k_dense_replace has one dense layer (transformers' default), Qwen3 without
    decoder_sparse_step / mlp_only_layers is MoE everywhere."""
    glm = {"architectures": ["Glm4MoeForCausalLM"], **SHAPE, "num_hidden_layers": 3, "n_routed_experts": 4}
    assert moe_layer_ids_from_hf_config(glm) == [1, 2]
    qwen = {k: v for k, v in QWEN3_V5.items() if k not in ("decoder_sparse_step", "mlp_only_layers")}
    assert moe_layer_ids_from_hf_config(qwen) == [0, 1, 2, 3]


def _write(tmp_path: Path, config: dict[str, Any], generation: dict[str, Any] | None = None) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        transformers.GenerationConfig(**generation).save_pretrained(str(tmp_path))
    return str(tmp_path)


@pytest.mark.parametrize(("config", "want"), [(QWEN3_V4, "bfloat16"), (QWEN3_V5, "bfloat16"),
                                              ({**QWEN3_V5, "dtype": "float16"}, "float16")])
def test_dtype_auto_is_the_dtype_config_json_names(tmp_path: Path, config: dict[str, Any], want: str) -> None:
    assert ModelConfig(model=_write(tmp_path, config), dtype="auto").finalize().dtype == want


def test_dtype_auto_without_a_dtype_key_says_what_to_pass(tmp_path: Path) -> None:
    config = {k: v for k, v in QWEN3_V5.items() if k != "dtype"}
    with pytest.raises(ConfigError, match="says the weights are None; pass one of float32, bfloat16, float16"):
        ModelConfig(model=_write(tmp_path, config), dtype="auto").finalize()


def test_generation_config_gives_eos_ids_and_sampling_defaults(tmp_path: Path) -> None:
    """As vLLM: eos ids joined (config.json's first), temperature/top_p/top_k/repetition_penalty and
    max_new_tokens (as max_tokens) are defaults; do_sample, which vLLM ignores, is not."""
    gen = {"eos_token_id": [7, 5], "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05,
           "do_sample": True, "max_new_tokens": 100}
    mc = ModelConfig(model=_write(tmp_path, {**QWEN3_V5, "eos_token_id": 5}, gen)).finalize()
    assert mc.eos_token_ids == [5, 7]
    assert mc.generation_defaults == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 100,
    }


def test_no_generation_config_means_no_defaults(tmp_path: Path) -> None:
    assert GenerationDefaults.read(str(tmp_path)) == GenerationDefaults([], {})
    mc = ModelConfig(model=_write(tmp_path, {**QWEN3_V5, "eos_token_id": [3, 4]})).finalize()
    assert (mc.eos_token_ids, mc.generation_defaults) == ([3, 4], {})
