"""Mixtral: every layer MoE, softmax top-k always renormalised; checkpoints call the MoE block
`block_sparse_moe` and the expert projections w1 (gate) / w3 (up) / w2 (down)."""

from __future__ import annotations

from typing import Any

import torch

from fastdeploy_r3.config.hf_config import moe_layer_ids_from_hf_config, normalize_hf_config
from fastdeploy_r3.model_executor.layers.expert_placement import ExpertPlacement
from fastdeploy_r3.model_executor.layers.moe import SparseMoeBlock
from fastdeploy_r3.model_executor.layers.rotary import RotaryEmbedding
from fastdeploy_r3.model_executor.layers.self_attention import SelfAttention
from fastdeploy_r3.model_executor.models.base import DecoderLayer, MoeCausalLM, rope_theta


class MixtralForCausalLM(MoeCausalLM):
    expert_proj_names = ("w1", "w3", "w2")
    checkpoint_mlp_name = "block_sparse_moe"

    def __init__(
        self,
        hf_config: dict[str, Any],
        dtype: torch.dtype,
        tp_rank: int = 0,
        tp_size: int = 1,
        expert_placement: ExpertPlacement | None = None,
    ) -> None:
        super().__init__()
        c = normalize_hf_config(hf_config)  # one key name per fact, transformers' defaults filled
        window = c.get("sliding_window")
        if window is not None and int(window) < int(c["max_position_embeddings"]):
            # silently ignoring the window would give wrong answers past it
            raise NotImplementedError(f"Mixtral with sliding_window={window} is not supported")
        hidden = int(c["hidden_size"])
        num_heads = int(c["num_attention_heads"])
        num_kv_heads = int(c["num_key_value_heads"])
        tp = {"tp_rank": tp_rank, "tp_size": tp_size}
        self.head_dim = int(c["head_dim"])
        eps = float(c["rms_norm_eps"])
        num_experts = int(c["num_experts"])
        top_k = int(c["num_experts_per_tok"])
        moe_layer_ids = moe_layer_ids_from_hf_config(c)
        rotary = RotaryEmbedding(self.head_dim, self.head_dim, rope_theta(c))
        layers = []
        for i in range(int(c["num_hidden_layers"])):
            attn = SelfAttention(hidden, num_heads, num_kv_heads, self.head_dim, rotary, i, rms_norm_eps=eps, **tp)
            mlp = SparseMoeBlock(
                hidden, num_experts, top_k, int(c["intermediate_size"]),
                moe_index=moe_layer_ids.index(i), router="softmax", renormalize=True, placement=expert_placement, **tp,
            )
            layers.append(DecoderLayer(attn, mlp, hidden, eps))
        self._build(c, layers, dtype, num_experts, top_k, moe_layer_ids, eps)
