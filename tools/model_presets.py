"""Real model shapes for load_format="dummy": a directory with config.json, generation_config.json and a
tokenizer, and no weights (the engine draws them on the device).

    python tools/make_fake_model.py --preset qwen3-30b-a3b --out /tmp/qwen3-30b-a3b
    LLM("/tmp/qwen3-30b-a3b", load_format="dummy", dtype="bfloat16", device="cuda")

The architecture fields are the published configs' (Hugging Face model cards, as of 2025). The special
token ids are not: the tokenizer written here is the fake byte-level BPE of fake_model.py grown to the
preset's vocabulary, whose special tokens sit at the end, and config.json names those, so that engine,
tokenizer and EOS agree. `num_hidden_layers` can be cut (the benchmark's --layers) to fit a smaller GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fake_model import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, build_tokenizer

_QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False, "use_sliding_window": False,
    "sliding_window": None, "torch_dtype": "bfloat16",
}

# the models expert parallelism is for (docs/expert_parallel.md): 470 GB / 710 GB in bf16
_QWEN3_235B_A22B: dict[str, Any] = {
    **_QWEN3_30B_A3B,
    "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
}

_GLM_45: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
    "hidden_size": 5120, "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536, "n_routed_experts": 160,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "partial_rotary_factor": 0.5, "use_qk_norm": True,
    "attention_bias": True, "num_nextn_predict_layers": 1, "vocab_size": 151552,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}

_GLM_45_AIR: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
    "hidden_size": 4096, "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 128,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 1.0, "partial_rotary_factor": 0.5, "use_qk_norm": False,
    "attention_bias": True, "num_nextn_predict_layers": 1, "vocab_size": 151552,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}

_MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "sliding_window": None, "torch_dtype": "bfloat16",
}

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "qwen3-235b-a22b": _QWEN3_235B_A22B,
    "glm-4.5": _GLM_45,
    "glm-4.5-air": _GLM_45_AIR,
    "mixtral-8x7b": _MIXTRAL_8X7B,
}


def preset_config(name: str, num_layers: int | None = None) -> dict[str, Any]:
    """config.json of preset `name` (optionally cut to num_layers decoder layers)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; use one of {', '.join(MODEL_PRESETS)}")
    hf = dict(MODEL_PRESETS[name])
    if num_layers is not None:
        if not 0 < num_layers <= hf["num_hidden_layers"]:
            raise ValueError(f"num_layers={num_layers}; {name} has 1..{hf['num_hidden_layers']} layers")
        hf["num_hidden_layers"] = num_layers
    vocab = hf["vocab_size"]
    hf["eos_token_id"] = vocab - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(EOS_TOKEN)
    hf["pad_token_id"] = vocab - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(PAD_TOKEN)
    hf["bos_token_id"] = None
    return hf


def write_preset(name: str, out: str, num_layers: int | None = None) -> str:
    """Write preset `name` to directory `out` (config, generation config, tokenizer; no weights); return `out`."""
    hf = preset_config(name, num_layers)
    os.makedirs(out, exist_ok=True)
    files = {
        "config.json": hf,
        "generation_config.json": {"eos_token_id": hf["eos_token_id"], "pad_token_id": hf["pad_token_id"],
                                   "do_sample": False},
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
            "bos_token": None, "unk_token": None, "model_max_length": hf["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
        },
    }
    for filename, obj in files.items():
        with open(os.path.join(out, filename), "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
    build_tokenizer(hf["vocab_size"]).save(os.path.join(out, "tokenizer.json"))
    return out


def save_hf_checkpoint(name: str, out: str, num_layers: int | None = None, device: str = "cpu") -> str:
    """Preset `name` as a real checkpoint: write_preset's files plus weights that the installed transformers
    initialises itself (`from_config`, its own random init, built on `device`) and writes with
    save_pretrained, in bfloat16. For tools that need an HF oracle at real shapes (tools/mismatch.py
    --preset); cut num_layers to fit the disk (Qwen3-30B-A3B: ~1.2 GB a layer)."""
    import torch
    import transformers

    write_preset(name, out, num_layers)
    config = transformers.AutoConfig.from_pretrained(out)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model a benchmark runs: --preset (real shapes, dummy weights) or the fake tiny qwen3_moe."""
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--preset", default=None, help="real-shape preset (tools/model_presets.py), dummy weights")
    ap.add_argument("--layers", type=int, default=None, help="cut the preset to this many layers")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 for a preset, float32 for the fake model")


def bench_model(args: argparse.Namespace, out: str) -> tuple[str, str, str]:
    """Resolve add_model_args' --device auto and --dtype in args, write the model into directory `out`;
    -> (model dir, load format, title)."""
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = args.dtype or ("bfloat16" if args.preset else "float32")
    if args.preset:
        return write_preset(args.preset, out, args.layers), "dummy", args.preset
    from fake_model import make_fake_model

    return make_fake_model("qwen3_moe", out, preset="tiny"), "auto", "fake tiny qwen3_moe"
