"""Tiny MoE checkpoints written by the installed `transformers` itself, as a trainer writes them after a
step: `XxxConfig(...)` + `XxxForCausalLM(config)` + `save_pretrained`, a tokenizer saved with
`save_pretrained` (its chat template lands in chat_template.jinja), and a generation_config.json with
sampling defaults. Nothing here is written by this project's own checkpoint writer.

    family      layers  MoE layers  why
    qwen3_moe   6       [1, 5]      decoder_sparse_step=2 and mlp_only_layers=[3]
    mixtral     3       [0, 1, 2]   tied embeddings (no lm_head.weight saved), a BOS-adding tokenizer
    glm4_moe    4       [2, 3]      first_k_dense_replace=2, grouped sigmoid router with correction bias,
                                    one random draft (MTP) layer whose weights are appended as GLM-4.5 does

write_glm_checkpoint_drafting_like_its_policy: a one-layer glm4_moe whose draft layer copies the policy, so
MTP speculative decoding accepts drafts.
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


def _mtp_layer_random(out: str, config, seed: int) -> dict[str, torch.Tensor]:  # noqa: ANN001 - Glm4MoeConfig
    """A random draft (MTP) layer at index num_hidden_layers, as GLM-4.5 ships it (transformers' Glm4Moe has
    no such module and drops these weights): a decoder layer with the MoE block under the names
    transformers saved its last layer with, and the draft layer's own enorm, hnorm, eh_proj [H, 2H],
    embed_tokens [V, H], shared_head.norm, shared_head.head [V, H]."""
    n, hidden, vocab = config.num_hidden_layers, config.hidden_size, config.vocab_size
    generator = torch.Generator().manual_seed(seed + 1)
    last = f"model.layers.{n - 1}."  # a MoE layer: first_k_dense_replace < num_hidden_layers
    saved = _saved_tensors(out)
    mtp: dict[str, torch.Tensor] = {}
    for name in sorted(k for k in saved if k.startswith(last)):
        draw = torch.randn(saved[name].shape, generator=generator)
        if name.endswith("norm.weight"):
            draw = 1.0 + draw * 0.1
        else:
            draw = draw * (_ROUTER_STD["glm4_moe"] if ".gate." in name else 0.15)
        mtp[f"model.layers.{n}." + name.removeprefix(last)] = draw
    for part, shape in [("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)),
                        ("shared_head.norm.weight", (hidden,)), ("eh_proj.weight", (hidden, 2 * hidden)),
                        ("embed_tokens.weight", (vocab, hidden)), ("shared_head.head.weight", (vocab, hidden))]:
        draw = torch.randn(shape, generator=generator)
        mtp[f"model.layers.{n}.{part}"] = 1.0 + draw * 0.1 if part.endswith("norm.weight") else draw * 0.5
    return mtp


def _mtp_layer_like_the_policy(out: str, config) -> dict[str, torch.Tensor]:  # noqa: ANN001 - Glm4MoeConfig
    """A draft layer that is the one-layer policy run one position ahead: its decoder layer, embedding, final
    norm and head are the policy's, eh_proj = [I | 0] passes the token's embedding and drops the hidden
    state, enorm = 1 (the embeddings have unit RMS, so enorm(e) = e up to eps). At position i it then
    computes the policy's layer over tokens 1..i+1 at shifted positions (RoPE sees the same relative
    positions), missing only token 0: its drafts are mostly the policy's own greedy tokens."""
    assert config.num_hidden_layers == 1
    hidden = config.hidden_size
    saved = _saved_tensors(out)
    mtp = {"model.layers.1." + k.removeprefix("model.layers.0."): v for k, v in saved.items()
           if k.startswith("model.layers.0.")}
    mtp["model.layers.1.embed_tokens.weight"] = saved["model.embed_tokens.weight"]
    mtp["model.layers.1.shared_head.norm.weight"] = saved["model.norm.weight"]
    mtp["model.layers.1.shared_head.head.weight"] = saved["lm_head.weight"]
    mtp["model.layers.1.enorm.weight"] = torch.ones(hidden)
    mtp["model.layers.1.hnorm.weight"] = torch.ones(hidden)
    mtp["model.layers.1.eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    return mtp


def _saved_tensors(out: str) -> dict[str, torch.Tensor]:
    """What save_pretrained wrote (one tensor per expert, as published checkpoints have them)."""
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "model.safetensors"))


def _append_mtp_layer(out: str, mtp: dict[str, torch.Tensor]) -> None:
    """Add the draft layer's tensors in a second shard, with an index, as GLM-4.5 ships them."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in mtp.items()}, os.path.join(out, "model-mtp.safetensors"),
              metadata={"format": "pt"})
    weight_map = dict.fromkeys(_saved_tensors(out), "model.safetensors")
    weight_map.update(dict.fromkeys(mtp, "model-mtp.safetensors"))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def write_glm_checkpoint_drafting_like_its_policy(out: str, seed: int = 0) -> str:
    """A one-layer GLM (its layer MoE) written by transformers, whose draft layer copies the policy
    (_mtp_layer_like_the_policy), so MTP drafts get accepted; return `out`."""
    import transformers

    config = hf_config("glm4_moe")
    config.num_hidden_layers, config.first_k_dense_replace = 1, 0
    model = transformers.Glm4MoeForCausalLM(config).float().eval()
    _draw_weights(model, "glm4_moe", seed)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt())  # unit RMS rows
    _save(model, "glm4_moe", out)
    _append_mtp_layer(out, _mtp_layer_like_the_policy(out, config))
    return out


def _save(model: torch.nn.Module, family: str, out: str) -> None:
    import transformers

    model.save_pretrained(out)
    save_tokenizer(family, out)
    transformers.GenerationConfig(
        eos_token_id=[EOS_ID, ENDOFTEXT_ID], pad_token_id=ENDOFTEXT_ID, do_sample=True, **GENERATION_DEFAULTS
    ).save_pretrained(out)


def write_hf_checkpoint(family: str, out: str, seed: int = 0, **overrides: object) -> str:
    """Write `family`'s tiny checkpoint to `out` with transformers' own save_pretrained; return `out`.
    overrides: config shapes other than _COMMON's (hf_config)."""
    config = hf_config(family, **overrides)
    model = _model_class(family)(config).float().eval()
    _draw_weights(model, family, seed)
    _save(model, family, out)
    if family == "glm4_moe":
        _append_mtp_layer(out, _mtp_layer_random(out, config, seed))
    return out
