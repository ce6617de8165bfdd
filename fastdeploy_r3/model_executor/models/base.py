"""The decoder skeleton the three MoE families share, and HF-checkpoint weight loading.

Module tree mirrors HF names (model.embed_tokens, model.layers.{i}.self_attn.q_proj, ...,
model.layers.{i}.mlp.gate, lm_head) so most checkpoint keys load by name. The exception is the
routed experts: checkpoints store one tensor per expert and projection,

    model.layers.1.mlp.experts.3.gate_proj.weight   [I, H]   (Mixtral: block_sparse_moe.experts.3.w1)
    model.layers.1.mlp.experts.3.up_proj.weight     [I, H]   (Mixtral: w3)
    model.layers.1.mlp.experts.3.down_proj.weight   [H, I]   (Mixtral: w2)

and we hold them stacked: experts.w13[3] = [gate; up] ([2I, H]) and experts.w2[3] ([H, I]).

Tensor parallel (N ranks, this one r): checkpoint names and shapes stay the full HF ones
(checkpoint_weight_shapes); load_weights copies rank r's slice into each sharded parameter.

    replicated:        embed_tokens, lm_head, norms, q/k norms, router (mlp.gate + correction bias)
    column-parallel:   q_proj, k_proj, v_proj (by heads, merged into self_attn.qkv_proj: one GEMM),
                       gate_proj, up_proj (dense + shared experts)
    row-parallel:      o_proj, down_proj (+ all-reduce)
    split on I:        routed experts (w13 rows, w2 columns; one all-reduce per MoE block)

Which routed experts a rank holds at all is the model's ExpertPlacement (layers/expert_placement.py;
the identity today): load_weights skips, and the loader never reads, the experts of other ranks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from fastdeploy_r3.errors import WeightLoadingError
from fastdeploy_r3.model_executor.layers.expert_placement import ExpertPlacement
from fastdeploy_r3.model_executor.layers.linear import ShardedLinear
from fastdeploy_r3.model_executor.layers.mlp import GatedMLP
from fastdeploy_r3.model_executor.layers.moe import SparseMoeBlock, StackedExperts
from fastdeploy_r3.model_executor.layers.norm import RMSNorm
from fastdeploy_r3.model_executor.layers.qkv_linear import QKVParallelLinear
from fastdeploy_r3.model_executor.layers.rotary import CosSin
from fastdeploy_r3.model_executor.layers.self_attention import SelfAttention
from fastdeploy_r3.model_executor.quantization.fp8 import BLOCK, SCALE_SUFFIX, expand_scale_rows, scale_shape
from fastdeploy_r3.model_executor.quantization.fp8_loading import weight_stream

__all__ = ["MoeCausalLM", "WeightLoadingError"]


def rope_theta(hf_config: dict[str, Any]) -> float:
    """theta of plain RoPE, from a normalized config's rope_parameters (hf_config.normalize_hf_config
    folds v4's top-level rope_theta / rope_scaling in).

    Only plain RoPE is implemented: scaled variants (YaRN, linear, dynamic...) are refused rather than
    silently computed as plain RoPE, which would give wrong answers past the original context.
    """
    rp = hf_config["rope_parameters"]
    if rp["rope_type"] != "default":
        raise NotImplementedError(f"rope_type {rp['rope_type']!r} is not supported (only plain RoPE)")
    return float(rp["rope_theta"])


class DecoderLayer(nn.Module):
    def __init__(self, self_attn: SelfAttention, mlp: GatedMLP | SparseMoeBlock, hidden_size: int,
                 rms_norm_eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: CosSin
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (the previous layer's MLP output, or the embeddings when residual is None), residual
        [T, H] (the running sum before it) -> (this layer's MLP output, the running sum before it).

        Each residual add is fused into the RMSNorm after it, so the stream is x_{l+1} = residual + x; the
        input norm runs inside the attention's qkv projection (which may fuse it into its GEMM).
        """
        h, residual = self.self_attn(positions, x, cos_sin, self.input_layernorm, residual)  # residual = x + residual
        # the post-attention norm (residual = attention out + residual) runs inside the MLP, whose MoE router
        # gate may fuse it (SparseMoeBlock.forward_normed)
        return self.mlp.forward_normed(h, self.post_attention_layernorm, residual)  # [T, H], [T, H]


class _Backbone(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, layers: list[DecoderLayer], rms_norm_eps: float) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, rms_norm_eps)


_EXPERT_KEY = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<param>weight|weight_scale_inv)$"
)
_QKV_KEY = re.compile(r"^(?P<attn>.+\.self_attn)\.(?P<shard>[qkv])_proj\.(?P<param>weight|bias|weight_scale_inv)$")


class MoeCausalLM(nn.Module):
    """Base of every family. Subclasses parse hf_config and call _build(layers, ...)."""

    # checkpoint names of an expert's (gate, up, down) projections, and the checkpoint's name for `mlp`
    expert_proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    checkpoint_mlp_name: str = "mlp"

    moe_layer_ids: list[int]
    expert_placement: ExpertPlacement  # the expert -> rank map every MoE layer of this model shares
    num_experts: int
    top_k: int
    num_layers: int
    num_kv_heads: int  # this rank's: the worker sizes its KV cache [.., KVH, D] from it
    head_dim: int

    def _build(
        self,
        hf_config: dict[str, Any],
        layers: list[DecoderLayer],
        dtype: torch.dtype,
        num_experts: int,
        top_k: int,
        moe_layer_ids: list[int],
        rms_norm_eps: float,
    ) -> None:
        hidden = int(hf_config["hidden_size"])
        vocab = int(hf_config["vocab_size"])
        self.hidden_size = hidden
        self.vocab_size = vocab
        self.num_experts = num_experts
        self.top_k = top_k
        self.moe_layer_ids = moe_layer_ids
        self.num_layers = len(layers)
        self.num_kv_heads = layers[0].self_attn.num_kv_heads  # this rank's share
        if any(layer.self_attn.rotary is not layers[0].self_attn.rotary for layer in layers):
            raise ValueError("every layer must share one RotaryEmbedding: forward computes cos/sin once")
        placements = {layer.mlp.experts.placement for layer in layers if isinstance(layer.mlp, SparseMoeBlock)}
        if len(placements) != 1:
            raise ValueError(f"every MoE layer must share one expert placement, got {len(placements)}")
        self.expert_placement = placements.pop()
        self.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", False))
        self.model = _Backbone(vocab, hidden, layers, rms_norm_eps)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.to(dtype)
        for module in self.modules():
            # GLM's sigmoid router (weight + selection bias) stays float32 whatever the model dtype, as in the
            # reference (_keep_in_fp32_modules_strict): routing decisions must not depend on bf16 rounding
            if isinstance(module, SparseMoeBlock) and module.router == "sigmoid_grouped":
                module.gate.float()

    # -- forward ------------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, H] (after the final norm)."""
        x = self.model.embed_tokens(input_ids)  # [T, H]
        cos_sin = self.model.layers[0].self_attn.rotary.cos_sin(positions)  # shared by every layer
        residual = None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual, cos_sin)
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32."""
        return self.lm_head(hidden).float()

    # -- weights ------------------------------------------------------------------------------------

    def holds_checkpoint_weight(self, ckpt_name: str) -> bool:
        """False for a routed expert's tensor that the placement gives another rank: the loader skips
        it without reading it. Every other name is this rank's (shards are cut from full tensors)."""
        m = _EXPERT_KEY.match(self._from_checkpoint_name(ckpt_name))
        placement = self.expert_placement
        if m is None or not 0 <= int(m["expert"]) < placement.num_experts:
            return True  # load_weights names what is wrong with an expert this model does not have
        return placement.local_slot(int(m["expert"])) is not None

    def _to_checkpoint_name(self, name: str) -> str:
        if self.checkpoint_mlp_name != "mlp":
            name = name.replace(".mlp.", f".{self.checkpoint_mlp_name}.")
        return name

    def _from_checkpoint_name(self, name: str) -> str:
        if self.checkpoint_mlp_name != "mlp":
            name = name.replace(f".{self.checkpoint_mlp_name}.", ".mlp.")
        return name

    def checkpoint_weight_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Every name (and shape) an HF checkpoint of this model holds; tied lm_head omitted. Built once
        (the model's structure never changes, and a trainer's update calls this once per bucket) and
        handed out read-only, so no caller can change what the next one is told."""
        cached = self.__dict__.get("_checkpoint_weight_shapes")
        if cached is None:
            cached = MappingProxyType(self._build_checkpoint_weight_shapes())
            self.__dict__["_checkpoint_weight_shapes"] = cached
        return cached

    def _build_checkpoint_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        gate_name, up_name, down_name = self.expert_proj_names
        for mod_name, module in self.named_modules():
            if isinstance(module, StackedExperts):
                prefix = self._to_checkpoint_name(mod_name)
                hidden, inter = module.w2.shape[1], module.full_intermediate_size
                for e in range(module.num_experts):
                    shapes[f"{prefix}.{e}.{gate_name}.weight"] = (inter, hidden)
                    shapes[f"{prefix}.{e}.{up_name}.weight"] = (inter, hidden)
                    shapes[f"{prefix}.{e}.{down_name}.weight"] = (hidden, inter)
        for name, tensor in self._loadable_tensors():
            module_name, param_name = name.rsplit(".", 1)
            module = self.get_submodule(module_name)
            if param_name.endswith(SCALE_SUFFIX):
                continue  # served layout; the checkpoint's follows from the weight's shape below
            if isinstance(module, QKVParallelLinear):
                if param_name == "weight":  # one pass per module: weight and bias names together
                    attn = self._to_checkpoint_name(module_name.rsplit(".", 1)[0])
                    for (shard, param), shape in module.checkpoint_shapes().items():
                        shapes[f"{attn}.{shard}_proj.{param}"] = shape
            elif isinstance(module, ShardedLinear):
                shapes[self._to_checkpoint_name(name)] = module.full_shape(param_name)
            elif not isinstance(module, StackedExperts):
                shapes[self._to_checkpoint_name(name)] = tuple(tensor.shape)
        for name in self.fp8_weight_names:  # quantization/fp8.py: [ceil(O/128), ceil(I/128)]
            shapes[name + SCALE_SUFFIX] = scale_shape(shapes[name])
        return shapes

    def checkpoint_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This model's weights as an HF checkpoint holds them (names and full shapes of
        checkpoint_weight_shapes; stacked experts split back per expert), e.g. for a trainer pushing
        them to a server. Views, not copies; a tensor-parallel shard has no full tensors to give."""
        if any(isinstance(m, ShardedLinear) and m.tp_size > 1 for m in self.modules()):
            raise WeightLoadingError("checkpoint_weights() needs the whole model (tensor_parallel_size 1)")
        if not self.expert_placement.is_identity:
            raise WeightLoadingError("checkpoint_weights() needs the whole model (every expert on this rank)")
        if self.fp8_weight_names:
            raise WeightLoadingError("checkpoint_weights() gives unquantized models' weights; this one serves fp8")
        gate_name, up_name, down_name = self.expert_proj_names
        split_back = (StackedExperts, QKVParallelLinear)
        for mod_name, module in self.named_modules():
            if isinstance(module, StackedExperts):
                prefix = self._to_checkpoint_name(mod_name)
                inter = module.intermediate_size
                for e in range(module.num_experts):
                    yield f"{prefix}.{e}.{gate_name}.weight", module.w13[e, :inter]  # [I, H]
                    yield f"{prefix}.{e}.{up_name}.weight", module.w13[e, inter:]  # [I, H]
                    yield f"{prefix}.{e}.{down_name}.weight", module.w2[e]  # [H, I]
            elif isinstance(module, QKVParallelLinear):  # HF keeps q_proj, k_proj, v_proj apart
                attn = self._to_checkpoint_name(mod_name.rsplit(".", 1)[0])
                for shard, param in module.checkpoint_shapes():
                    yield f"{attn}.{shard}_proj.{param}", module.shard(shard, param)
        for name, tensor in self._loadable_tensors():
            if not isinstance(self.get_submodule(name.rsplit(".", 1)[0]), split_back):
                yield self._to_checkpoint_name(name), tensor

    fp8_weight_names: frozenset[str] = frozenset()  # set by quantization.quantize_layers

    def _loadable_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        # named_parameters() drops the tied lm_head.weight as a duplicate, which is what we want
        yield from self.named_parameters()
        for name, buf in self.named_buffers():
            if name.endswith("e_score_correction_bias"):
                yield name, buf

    def check_checkpoint_weights(self, shapes: dict[str, tuple[int, ...]], require_all: bool) -> None:
        """Raise WeightLoadingError unless every (name, full shape) is one this model loads or deliberately
        skips, and, with require_all, every weight of the model is there. Reads no tensor data, so a
        weight update can refuse a wrong checkpoint before it changes a single parameter."""
        expected = self.checkpoint_weight_shapes()
        for name, shape in shapes.items():
            if name not in expected:
                if self._skip_checkpoint_weight(name) or (self.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                raise WeightLoadingError(
                    f"unexpected weight {name!r}: {type(self).__name__} has no such parameter (the weights are "
                    "for another architecture or config)"
                )
            if tuple(shape) != expected[name]:
                raise WeightLoadingError(
                    f"weight {name!r} has shape {tuple(shape)}, the model expects {expected[name]}"
                )
        if require_all:  # a float weight of an fp8 layer comes without a scale: it is quantized on arrival
            missing = sorted(n for n in set(expected) - set(shapes) if not n.endswith(SCALE_SUFFIX))
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise WeightLoadingError(f"weight {missing[0]!r}{more} is missing from the checkpoint")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
        """Load HF checkpoint tensors by name; raise WeightLoadingError naming any bad or missing key.

        Routed experts the placement gives other ranks are checked and skipped (holds_checkpoint_weight),
        and not required. strict=False loads a subset (a weight update that sends some tensors): nothing
        is required.
        """
        expected = self.checkpoint_weight_shapes()
        modules = self.__dict__.get("_modules_by_name")  # the structure never changes; one walk per model
        if modules is None:
            modules = self.__dict__["_modules_by_name"] = dict(self.named_modules())
        loaded: set[str] = set()
        gate_name, up_name, down_name = self.expert_proj_names
        for ckpt_name, w in weight_stream(weights, self.fp8_weight_names, expected):
            if self.tie_word_embeddings and ckpt_name == "lm_head.weight":
                continue  # some tied checkpoints still store it; the embedding is authoritative
            if ckpt_name not in expected:
                if self._skip_checkpoint_weight(ckpt_name):
                    continue
                raise WeightLoadingError(
                    f"unexpected weight {ckpt_name!r} in the checkpoint: {type(self).__name__} built from "
                    "config.json has no such parameter (config.json and the weights disagree)"
                )
            if tuple(w.shape) != expected[ckpt_name]:
                raise WeightLoadingError(
                    f"weight {ckpt_name!r} has shape {tuple(w.shape)}, the model expects {expected[ckpt_name]}"
                )
            if not self.holds_checkpoint_weight(ckpt_name):
                continue
            name = self._from_checkpoint_name(ckpt_name)
            if name.endswith(SCALE_SUFFIX):  # rows expanded: stacks and shards cut it like the weight
                w = expand_scale_rows(w, expected[ckpt_name.removesuffix(SCALE_SUFFIX)][0], BLOCK)
            m = _EXPERT_KEY.match(name)
            qkv = _QKV_KEY.match(name)
            if m is not None:
                proj = {gate_name: "gate", up_name: "up", down_name: "down"}[m["proj"]]
                modules[m["prefix"]].load_expert(int(m["expert"]), proj, w, m["param"])
            elif qkv is not None:
                modules[f"{qkv['attn']}.qkv_proj"].load_shard(qkv["shard"], qkv["param"], w)
            else:
                module_name, param_name = name.rsplit(".", 1)
                module = modules[module_name]
                if isinstance(module, ShardedLinear):
                    module.load_shard(param_name, w)
                else:
                    getattr(module, param_name).copy_(w)  # a parameter or the GLM bias buffer
            loaded.add(ckpt_name)
        if not strict:
            return  # a subset is fine: nothing to look for
        missing = sorted(n for n in set(expected) - loaded if self.holds_checkpoint_weight(n))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise WeightLoadingError(f"weight {missing[0]!r}{more} is missing from the checkpoint")

    draft_layer: nn.Module | None = None  # the draft (MTP) layer of a model built with one (models/glm4_mtp.py)

    def is_draft_weight(self, ckpt_name: str) -> bool:
        """Whether a checkpoint name belongs to a draft (MTP) layer rather than the policy."""
        return False

    def _skip_checkpoint_weight(self, ckpt_name: str) -> bool:
        """Checkpoint tensors this engine deliberately ignores (e.g. GLM's multi-token-prediction layers)."""
        return False
