"""GLM-4.5 (Glm4MoeForCausalLM): dense first_k_dense_replace layers, sigmoid grouped routing with a
selection-only correction bias, shared experts, partial rotary, optional q/k norm and qkv bias."""

from __future__ import annotations

import re
from typing import Any

import torch

from fastdeploy_r3.config import moe_layer_ids_from_hf_config
from fastdeploy_r3.model_executor.layers.mlp import GatedMLP
from fastdeploy_r3.model_executor.layers.moe import SparseMoeBlock
from fastdeploy_r3.model_executor.layers.rotary import RotaryEmbedding
from fastdeploy_r3.model_executor.models.base import DecoderLayer, MoeCausalLM, SelfAttention, rope_theta

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


class Glm4MoeForCausalLM(MoeCausalLM):
    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        c = hf_config
        hidden = int(c["hidden_size"])
        num_heads = int(c["num_attention_heads"])
        num_kv_heads = int(c.get("num_key_value_heads", num_heads))
        tp = {"tp_rank": tp_rank, "tp_size": tp_size}
        self.head_dim = int(c.get("head_dim") or hidden // num_heads)
        eps = float(c.get("rms_norm_eps", 1e-5))
        num_experts = int(c["n_routed_experts"])
        top_k = int(c["num_experts_per_tok"])
        moe_layer_ids = moe_layer_ids_from_hf_config(c)
        rp = c.get("rope_parameters") or {}
        factor = float(rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5)))
        rotary = RotaryEmbedding(self.head_dim, int(self.head_dim * factor), rope_theta(c))
        moe_inter = int(c["moe_intermediate_size"])
        self.num_hidden_layers = int(c["num_hidden_layers"])
        layers = []
        for i in range(self.num_hidden_layers):
            attn = SelfAttention(
                hidden, num_heads, num_kv_heads, self.head_dim, rotary, i,
                qkv_bias=bool(c.get("attention_bias", False)), o_bias=False,
                qk_norm=bool(c.get("use_qk_norm", False)), rms_norm_eps=eps, **tp,
            )
            if i in moe_layer_ids:
                mlp = SparseMoeBlock(
                    hidden, num_experts, top_k, moe_inter,
                    moe_index=moe_layer_ids.index(i), router="sigmoid_grouped",
                    renormalize=bool(c.get("norm_topk_prob", True)),
                    n_group=int(c.get("n_group", 1)), topk_group=int(c.get("topk_group", 1)),
                    routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
                    shared_intermediate_size=moe_inter * int(c.get("n_shared_experts", 1)), **tp,
                )
            else:
                mlp = GatedMLP(hidden, int(c["intermediate_size"]), **tp)
            layers.append(DecoderLayer(attn, mlp, hidden, eps))
        self._build(c, layers, dtype, num_experts, top_k, moe_layer_ids, eps)

    def _skip_checkpoint_weight(self, ckpt_name: str) -> bool:
        # real GLM-4.5 checkpoints append num_nextn_predict_layers MTP layers after the last decoder layer
        m = _LAYER_KEY.match(ckpt_name)
        return m is not None and int(m.group(1)) >= self.num_hidden_layers
