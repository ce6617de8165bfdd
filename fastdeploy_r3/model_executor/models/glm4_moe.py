"""GLM-4.5 (Glm4MoeForCausalLM): dense first_k_dense_replace layers, sigmoid grouped routing with a
selection-only correction bias, shared experts, partial rotary, optional q/k norm and qkv bias."""

from __future__ import annotations

import re
from typing import Any

import torch

from fastdeploy_r3.config.hf_config import moe_layer_ids_from_hf_config, normalize_hf_config
from fastdeploy_r3.model_executor.layers.mlp import GatedMLP
from fastdeploy_r3.model_executor.layers.moe import SparseMoeBlock
from fastdeploy_r3.model_executor.layers.rotary import RotaryEmbedding
from fastdeploy_r3.model_executor.models.base import DecoderLayer, MoeCausalLM, SelfAttention, rope_theta

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


class Glm4MoeForCausalLM(MoeCausalLM):
    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        c = normalize_hf_config(hf_config)  # one key name per fact, transformers' defaults filled
        hidden = int(c["hidden_size"])
        num_heads = int(c["num_attention_heads"])
        num_kv_heads = int(c["num_key_value_heads"])
        tp = {"tp_rank": tp_rank, "tp_size": tp_size}
        self.head_dim = int(c["head_dim"])
        eps = float(c["rms_norm_eps"])
        num_experts = int(c["num_experts"])
        top_k = int(c["num_experts_per_tok"])
        moe_layer_ids = moe_layer_ids_from_hf_config(c)
        factor = float(c["rope_parameters"]["partial_rotary_factor"])
        rotary = RotaryEmbedding(self.head_dim, int(self.head_dim * factor), rope_theta(c))
        moe_inter = int(c["moe_intermediate_size"])
        self.num_hidden_layers = int(c["num_hidden_layers"])
        self.num_nextn_predict_layers = int(c["num_nextn_predict_layers"])
        layers = []
        for i in range(self.num_hidden_layers):
            attn = SelfAttention(
                hidden, num_heads, num_kv_heads, self.head_dim, rotary, i,
                qkv_bias=bool(c["attention_bias"]), o_bias=False,
                qk_norm=bool(c["use_qk_norm"]), rms_norm_eps=eps, **tp,
            )
            if i in moe_layer_ids:
                mlp = SparseMoeBlock(
                    hidden, num_experts, top_k, moe_inter,
                    moe_index=moe_layer_ids.index(i), router="sigmoid_grouped",
                    renormalize=bool(c["norm_topk_prob"]),
                    n_group=int(c["n_group"]), topk_group=int(c["topk_group"]),
                    routed_scaling_factor=float(c["routed_scaling_factor"]),
                    shared_intermediate_size=moe_inter * int(c["n_shared_experts"]), **tp,
                )
            else:
                mlp = GatedMLP(hidden, int(c["intermediate_size"]), **tp)
            layers.append(DecoderLayer(attn, mlp, hidden, eps))
        self._build(c, layers, dtype, num_experts, top_k, moe_layer_ids, eps)

    def _skip_checkpoint_weight(self, ckpt_name: str) -> bool:
        # GLM-4.5 checkpoints append num_nextn_predict_layers draft (MTP) layers after the last decoder layer;
        # this engine does not draft, so they are never loaded (and never an R3 row). A layer past them is
        # still an unexpected weight.
        m = _LAYER_KEY.match(ckpt_name)
        if m is None:
            return False
        return self.num_hidden_layers <= int(m.group(1)) < self.num_hidden_layers + self.num_nextn_predict_layers
