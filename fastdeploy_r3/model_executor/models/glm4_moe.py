"""GLM-4.5 (Glm4MoeForCausalLM): dense first_k_dense_replace layers, sigmoid grouped routing with a
selection-only correction bias, shared experts, partial rotary, optional q/k norm and qkv bias; with
with_draft_layers, also the checkpoint's first draft (MTP) layer (models/glm4_mtp.py) as `mtp.{L}`."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from fastdeploy_r3.config import ConfigError
from fastdeploy_r3.config.hf_config import moe_layer_ids_from_hf_config, normalize_hf_config
from fastdeploy_r3.model_executor.layers.expert_placement import ExpertPlacement
from fastdeploy_r3.model_executor.layers.mlp import GatedMLP
from fastdeploy_r3.model_executor.layers.moe import SparseMoeBlock
from fastdeploy_r3.model_executor.layers.rotary import RotaryEmbedding
from fastdeploy_r3.model_executor.layers.self_attention import SelfAttention
from fastdeploy_r3.model_executor.models.base import DecoderLayer, MoeCausalLM, rope_theta
from fastdeploy_r3.model_executor.models.glm4_mtp import Glm4MoeMtpLayer

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


class Glm4MoeForCausalLM(MoeCausalLM):
    def __init__(
        self,
        hf_config: dict[str, Any],
        dtype: torch.dtype,
        tp_rank: int = 0,
        tp_size: int = 1,
        expert_placement: ExpertPlacement | None = None,
        with_draft_layers: bool = False,
    ) -> None:
        """with_draft_layers: build (and load) the first of the checkpoint's num_nextn_predict_layers draft
        layers, for MTP speculative decoding; without it their weights are skipped."""
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
        if with_draft_layers and self.num_nextn_predict_layers < 1:
            raise ConfigError("this GLM checkpoint has no draft (MTP) layer (num_nextn_predict_layers is 0 in "
                              'config.json): use {"method": "ngram"} speculative decoding')
        num_built = self.num_hidden_layers + (1 if with_draft_layers else 0)
        layers = []
        for i in range(num_built):
            attn = SelfAttention(
                hidden, num_heads, num_kv_heads, self.head_dim, rotary, i if i < self.num_hidden_layers else 0,
                qkv_bias=bool(c["attention_bias"]), o_bias=False,
                qk_norm=bool(c["use_qk_norm"]), rms_norm_eps=eps, **tp,
            )
            if i in moe_layer_ids or i == self.num_hidden_layers:
                mlp = SparseMoeBlock(
                    hidden, num_experts, top_k, moe_inter,
                    # the draft layer's index is past the policy's: see models/glm4_mtp.py's R3 invariant
                    moe_index=moe_layer_ids.index(i) if i in moe_layer_ids else len(moe_layer_ids),
                    router="sigmoid_grouped",
                    renormalize=bool(c["norm_topk_prob"]),
                    n_group=int(c["n_group"]), topk_group=int(c["topk_group"]),
                    routed_scaling_factor=float(c["routed_scaling_factor"]),
                    shared_intermediate_size=moe_inter * int(c["n_shared_experts"]), placement=expert_placement, **tp,
                )
            else:
                mlp = GatedMLP(hidden, int(c["intermediate_size"]), **tp)
            layers.append(DecoderLayer(attn, mlp, hidden, eps))
        self.mtp: nn.ModuleDict | None = None
        if with_draft_layers:
            last = layers.pop()
            # named as in the checkpoint, after layer index: mtp.46.* <-> model.layers.46.*
            self.mtp = nn.ModuleDict({str(self.num_hidden_layers): Glm4MoeMtpLayer(
                last.self_attn, last.mlp, hidden, int(c["vocab_size"]), eps)})
        self._build(c, layers, dtype, num_experts, top_k, moe_layer_ids, eps)

    @property
    def draft_layer(self) -> Glm4MoeMtpLayer | None:
        return None if self.mtp is None else self.mtp[str(self.num_hidden_layers)]

    def is_draft_weight(self, ckpt_name: str) -> bool:
        m = _LAYER_KEY.match(ckpt_name)
        return m is not None and int(m.group(1)) >= self.num_hidden_layers

    def _to_checkpoint_name(self, name: str) -> str:
        if name.startswith("mtp."):
            return "model.layers." + name.removeprefix("mtp.")
        return super()._to_checkpoint_name(name)

    def _from_checkpoint_name(self, name: str) -> str:
        if self.draft_layer is not None and self.is_draft_weight(name):
            return "mtp." + name.removeprefix("model.layers.")
        return super()._from_checkpoint_name(name)

    def _skip_checkpoint_weight(self, ckpt_name: str) -> bool:
        # GLM-4.5 checkpoints append num_nextn_predict_layers draft (MTP) layers after the last decoder layer;
        # they are loaded only for MTP drafts (the first of them, as SGLang's NEXTN does), and never make an
        # R3 row. A layer past them is still an unexpected weight.
        m = _LAYER_KEY.match(ckpt_name)
        if m is None:
            return False
        first = self.num_hidden_layers + (0 if self.draft_layer is None else 1)
        return first <= int(m.group(1)) < self.num_hidden_layers + self.num_nextn_predict_layers
