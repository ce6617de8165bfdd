"""Tiny MoE checkpoints written by the installed `transformers` itself, as a trainer writes them after a
step: `XxxConfig(...)` + `XxxForCausalLM(config)` + `save_pretrained`, a tokenizer saved with
`save_pretrained` (its chat template lands in chat_template.jinja), and a generation_config.json with
sampling defaults. Nothing here is written by this project's own checkpoint writer.

    family      layers  MoE layers  why
    qwen3_moe   6       [1, 5]      decoder_sparse_step=2 and mlp_only_layers=[3]
    mixtral     3       [0, 1, 2]   tied embeddings (no lm_head.weight saved), a BOS-adding tokenizer
    glm4_moe    4       [2, 3]      first_k_dense_replace=2, grouped sigmoid router with correction bias,
                                    one draft (MTP) layer whose weights are appended as real GLM-4.5 does
"""

from __future__ import annotations

import json
import os

import torch

FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe")
MOE_LAYER_IDS = {"qwen3_moe": [1, 5], "mixtral": [0, 1, 2], "glm4_moe": [2, 3]}

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>")
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # byte-level tokens + specials: every text encodes, every id decodes
EOS_ID = 256 + SPECIAL_TOKENS.index("<|im_end|>")  # 258
ENDOFTEXT_ID = 256 + SPECIAL_TOKENS.index("<|endoftext|>")  # 256
BOS_ID = 256 + SPECIAL_TOKENS.index("<s>")  # 259
GENERATION_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 20}

# ChatML with a tools header; Mixtral's tokenizer also gets a BOS in front (its template writes bos_token)
CHAT_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function') | map(attribute='name') "
    "| join(', ') }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' and loop.first %}{{ raise_exception('a tool message cannot come first') }}"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COMMON = {
    "vocab_size": VOCAB_SIZE, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "max_position_embeddings": 256, "eos_token_id": EOS_ID, "pad_token_id": ENDOFTEXT_ID,
    "bos_token_id": None,
}
_ROUTER_STD = {"qwen3_moe": 0.5, "mixtral": 0.5, "glm4_moe": 0.15}  # sigmoid routers saturate: tamer


def hf_config(family: str, **overrides: object):  # -> transformers.PretrainedConfig
    """overrides replace _COMMON's shapes (e.g. num_key_value_heads=4, so that 4 tensor-parallel ranks
    split the kv heads)."""
    import transformers

    common = {**_COMMON, **overrides}
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, num_hidden_layers=6, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            intermediate_size=48, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True,
            architectures=["Qwen3MoeForCausalLM"],
        )
    if family == "mixtral":
        return transformers.MixtralConfig(
            **{**common, "bos_token_id": BOS_ID}, num_hidden_layers=3, num_local_experts=8,
            num_experts_per_tok=2, intermediate_size=16, tie_word_embeddings=True,
            architectures=["MixtralForCausalLM"],
        )
    if family == "glm4_moe":
        return transformers.Glm4MoeConfig(
            **common, num_hidden_layers=4, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=16,
            intermediate_size=48, first_k_dense_replace=2, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True, num_nextn_predict_layers=1,
            architectures=["Glm4MoeForCausalLM"],
        )
    raise ValueError(f"unknown family {family!r}; use one of {', '.join(FAMILIES)}")


def _model_class(family: str):  # -> type[transformers.PreTrainedModel]
    import transformers

    return {
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
        "glm4_moe": transformers.Glm4MoeForCausalLM,
    }[family]


@torch.no_grad()
def _draw_weights(model: torch.nn.Module, family: str, seed: int) -> None:
    """Redraw every tensor with a role-dependent std: transformers' init (std 0.02) leaves router and lm_head
    logits so flat that top-k and argmax become near-ties, which makes an exact oracle flaky."""
    generator = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    for name in sorted(tensors):
        t = tensors[name]
        if name.endswith("norm.weight"):
            t.copy_(1.0 + torch.randn(t.shape, generator=generator) * 0.1)
        elif name.endswith(".gate.weight"):  # the router
            t.copy_(torch.randn(t.shape, generator=generator) * _ROUTER_STD[family])
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            t.copy_(torch.randn(t.shape, generator=generator) * 0.5)
        elif name.endswith(("bias", "e_score_correction_bias")):
            t.copy_(torch.randn(t.shape, generator=generator) * 0.05)
        else:
            t.copy_(torch.randn(t.shape, generator=generator) * 0.15)


def save_tokenizer(family: str, out: str) -> None:
    """A byte-level BPE (no merges) tokenizer saved by transformers; Mixtral's adds a BOS, as its config says."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    kwargs = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    if family == "mixtral":
        kwargs.update(bos_token="<s>", add_bos_token=True)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    assert len(tokenizer) == VOCAB_SIZE


def _append_mtp_layer(out: str, config) -> None:  # noqa: ANN001 - transformers.Glm4MoeConfig
    """Add a draft layer at index num_hidden_layers in a second shard, with an index, as GLM-4.5 ships it."""
    from safetensors.torch import save_file

    n, hidden, experts = config.num_hidden_layers, config.hidden_size, config.n_routed_experts
    mtp = {
        f"model.layers.{n}.eh_proj.weight": torch.ones(hidden, 2 * hidden),
        f"model.layers.{n}.enorm.weight": torch.ones(hidden),
        f"model.layers.{n}.mlp.gate.weight": torch.ones(experts, hidden),
        f"model.layers.{n}.mlp.experts.0.gate_proj.weight": torch.ones(config.moe_intermediate_size, hidden),
    }
    save_file(mtp, os.path.join(out, "model-mtp.safetensors"), metadata={"format": "pt"})
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    weight_map.update(dict.fromkeys(mtp, "model-mtp.safetensors"))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def write_hf_checkpoint(family: str, out: str, seed: int = 0, **overrides: object) -> str:
    """Write `family`'s tiny checkpoint to `out` with transformers' own save_pretrained; return `out`.
    overrides: config shapes other than _COMMON's (hf_config)."""
    import transformers

    config = hf_config(family, **overrides)
    model = _model_class(family)(config).float().eval()
    _draw_weights(model, family, seed)
    model.save_pretrained(out)
    save_tokenizer(family, out)
    transformers.GenerationConfig(
        eos_token_id=[EOS_ID, ENDOFTEXT_ID], pad_token_id=ENDOFTEXT_ID, do_sample=True, **GENERATION_DEFAULTS
    ).save_pretrained(out)
    if family == "glm4_moe":
        _append_mtp_layer(out, config)
    return out
