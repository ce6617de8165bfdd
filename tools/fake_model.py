"""Deterministic random MoE checkpoints in Hugging Face format, for tests and benchmarks (a fixture
writer, kept beside the tools that use it; tests import it as `fake_model` via pytest.ini's pythonpath).

A directory holds config.json, generation_config.json, model.safetensors and a byte-level BPE
tokenizer (tokenizer.json + tokenizer_config.json) whose vocabulary is exactly config vocab_size;
both this project and `transformers` load it. Same (arch, preset, seed) -> byte-identical files.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter
from typing import Any

import torch

ARCHS = ("qwen3_moe", "glm4_moe", "mixtral")
PRESETS = ("tiny", "small")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# merges are learned from this text; any text still encodes through the 256 byte tokens
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a few "
    "experts chosen by a router; the serving engine records which experts were chosen so that the "
    "trainer can replay the same routing. Hello world! How are you today? I am fine, thank you. "
    "What is the capital of France? The capital of France is Paris. Tell me a story about a cat who "
    "lived in a house by the sea, and the sea was blue and the sky was bright. Numbers: 0 1 2 3 4 5 6 "
    "7 8 9 10 100 1000. def main():\n    return 42\nimport torch\nfor i in range(10):\n    print(i)\n"
    "Once upon a time there was a model that could generate text, and people asked it questions about "
    "science, history, mathematics and programming. The answer is yes. The answer is no. Please write "
    "a poem about the moon and the stars in the night."
)

_SIZES = {
    # name: hidden, layers, routed experts, top-k, heads, kv heads, head_dim, moe intermediate, dense intermediate
    "tiny": {
        "hidden": 64, "layers": 4, "experts": 16, "top_k": 4, "heads": 4, "kv_heads": 2, "head_dim": 16,
        "moe_inter": 32, "inter": 128,
    },
    "small": {
        "hidden": 256, "layers": 8, "experts": 64, "top_k": 8, "heads": 8, "kv_heads": 4, "head_dim": 32,
        "moe_inter": 128, "inter": 512,
    },
}
VOCAB_SIZE = 512
MAX_POSITION_EMBEDDINGS = 512
# softmax routers tolerate large logits; sigmoid ones saturate (ties at 1.0), so GLM's router is tamer
_ROUTER_STD = {"qwen3_moe": 0.5, "mixtral": 0.5, "glm4_moe": 0.15}


def fake_hf_config(arch: str, preset: str = "tiny") -> dict[str, Any]:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; use one of {', '.join(ARCHS)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; use one of {', '.join(PRESETS)}")
    s = _SIZES[preset]
    eos_id = VOCAB_SIZE - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(EOS_TOKEN)
    pad_id = VOCAB_SIZE - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(PAD_TOKEN)
    common: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "num_experts_per_tok": s["top_k"],
        "tie_word_embeddings": False,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "bos_token_id": None,
        "torch_dtype": "float32",
    }
    if arch == "qwen3_moe":
        return {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common,
            "num_experts": s["experts"], "moe_intermediate_size": s["moe_inter"], "intermediate_size": s["inter"],
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None,
        }
    if arch == "mixtral":
        return {
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common,
            "num_local_experts": s["experts"], "intermediate_size": s["moe_inter"], "sliding_window": None,
        }
    return {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **common,
        "n_routed_experts": s["experts"], "moe_intermediate_size": s["moe_inter"], "intermediate_size": s["inter"],
        "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "attention_bias": True, "use_qk_norm": True,
        "partial_rotary_factor": 0.5, "num_nextn_predict_layers": 0,
    }


def _learn_merges(num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE on the corpus's byte-level pre-tokens; ties broken by the pair's text (deterministic)."""
    from tokenizers import pre_tokenizers

    words = Counter(w for w, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(_CORPUS))
    seqs = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, seq in seqs.items():
            for a, b in itertools.pairwise(seq):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for w, seq in seqs.items():
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == best:
                    out.append(seq[i] + seq[i + 1])
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[w] = out
    return merges


def build_tokenizer(vocab_size: int = VOCAB_SIZE):  # -> tokenizers.Tokenizer
    """Byte-level BPE: 256 byte tokens + learned merges (+ reserved fillers) + SPECIAL_TOKENS last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    num_merges = vocab_size - len(alphabet) - len(SPECIAL_TOKENS)
    merges = _learn_merges(num_merges)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    fillers = [f"<|reserved_{i}|>" for i in range(vocab_size - len(SPECIAL_TOKENS) - len(vocab))]
    for tok in fillers:
        vocab[tok] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(fillers) + list(SPECIAL_TOKENS))
    assert tokenizer.get_vocab_size() == vocab_size, (tokenizer.get_vocab_size(), vocab_size)
    return tokenizer


# what a block-wise fp8 checkpoint's config.json says (Qwen3-30B-A3B-FP8's, and what vLLM / SGLang read)
FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
}


def make_fake_model(
    arch: str, out: str, preset: str = "tiny", seed: int = 0, dtype: str = "float32", fp8: bool = False,
    draft_layer: bool = False,
) -> str:
    """Write a random `arch` checkpoint to directory `out` (created if needed); return `out`.

    dtype: the dtype the weights are saved in ("float32" or "bfloat16": the float32 draws rounded).
    fp8: save them as a block-wise fp8 checkpoint instead, in the published layout: every dense linear and
    expert projection `X.weight` float8_e4m3fn with `X.weight_scale_inv` float32 [ceil(O/128), ceil(I/128)],
    quantized from the `dtype` weights (model_executor/quantization/fp8.py); router gates, norms, embeddings
    and lm_head stay in `dtype`; config.json gets FP8_QUANTIZATION_CONFIG.
    draft_layer (glm4_moe only): also a draft (MTP) layer, as GLM-4.5 ships one (num_nextn_predict_layers 1,
    model.layers.{L}.* after the L decoder layers), for {"method": "mtp"} speculative decoding; the policy's
    weights are the same draws as without it."""
    from safetensors.torch import save_file

    from fastdeploy_r3.model_executor.model_loader import random_weights
    from fastdeploy_r3.model_executor.models.registry import get_model_class
    from fastdeploy_r3.model_executor.quantization.fp8 import SCALE_SUFFIX, quantize_blockwise
    from fastdeploy_r3.model_executor.quantization.fp8_loading import quantize_layers

    hf = fake_hf_config(arch, preset)
    os.makedirs(out, exist_ok=True)
    if draft_layer:
        if arch != "glm4_moe":
            raise ValueError(f"only glm4_moe checkpoints carry a draft (MTP) layer, not {arch}")
        hf["num_nextn_predict_layers"] = 1
    draft = {"with_draft_layers": True} if draft_layer else {}
    model = get_model_class(hf["architectures"][0])(hf, torch.float32, **draft)
    weights = random_weights(model, seed, router_std=_ROUTER_STD[arch])
    weights = {name: w.to(getattr(torch, dtype)) for name, w in weights.items()}
    hf["torch_dtype"] = dtype
    if fp8:
        for name in sorted(quantize_layers(model)):  # the checkpoint names of the fp8 layers' weights
            weights[name], weights[name + SCALE_SUFFIX] = quantize_blockwise(weights[name])
        hf["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    _write_json(os.path.join(out, "config.json"), hf)
    _write_json(
        os.path.join(out, "generation_config.json"),
        {"eos_token_id": hf["eos_token_id"], "pad_token_id": hf["pad_token_id"], "do_sample": False},
    )
    build_tokenizer(hf["vocab_size"]).save(os.path.join(out, "tokenizer.json"))
    _write_json(
        os.path.join(out, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "bos_token": None,
            "unk_token": None,
            "model_max_length": MAX_POSITION_EMBEDDINGS,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    return out


def _write_json(path: str, obj: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
