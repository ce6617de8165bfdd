"""Build a model from a finalized ModelConfig and fill it from *.safetensors (or random weights)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from torch import nn

from fastdeploy_r3.config import ConfigError, ModelConfig, num_routed_experts_from_hf_config
from fastdeploy_r3.dtypes import torch_dtype
from fastdeploy_r3.model_executor.models.base import WeightLoadingError
from fastdeploy_r3.model_executor.models.registry import get_model_class


def random_weight(name: str, shape: tuple[int, ...], generator: torch.Generator, router_std: float) -> torch.Tensor:
    """One deterministic random float32 tensor, scaled by role.

    Router weights get a large std so that top-k scores have clear gaps (near-ties make routing
    oracles flaky); norms stay near 1 so activations keep their scale through the layers.
    """
    if name.endswith("e_score_correction_bias"):
        return torch.randn(shape, generator=generator) * 0.05
    if name.endswith("norm.weight"):
        return 1.0 + torch.randn(shape, generator=generator) * 0.1
    if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
        return torch.randn(shape, generator=generator) * router_std
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        return torch.randn(shape, generator=generator) * 0.5
    if name.endswith(".bias"):
        return torch.randn(shape, generator=generator) * 0.05
    return torch.randn(shape, generator=generator) * 0.08


def random_weights(model: nn.Module, seed: int, router_std: float = 0.5) -> dict[str, torch.Tensor]:
    """Random HF-named checkpoint tensors for `model`, a pure function of (architecture, config, seed)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = model.checkpoint_weight_shapes()
    # sorted: the draw order, hence every byte, depends only on the names
    return {name: random_weight(name, shapes[name], generator, router_std) for name in sorted(shapes)}


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise WeightLoadingError(
            f"no *.safetensors in {model_dir!r}; convert the checkpoint to safetensors or use load_format='dummy'"
        )
    return [os.path.join(model_dir, f) for f in files]


def _iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def load_model(model_config: ModelConfig, device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> nn.Module:
    """Model of model_config's architecture on `device`, weights loaded, eval mode, grads off.

    With tp_size > 1 the model holds tensor-parallel rank tp_rank's shard of every split weight.
    """
    hf = model_config.hf_config
    if not hf:
        raise ConfigError("load_model() needs a finalized ModelConfig (call model_config.finalize())")
    arch = (hf.get("architectures") or [None])[0]
    model_cls = get_model_class(arch)
    if num_routed_experts_from_hf_config(hf) <= 0 or int(hf.get("num_experts_per_tok", 0) or 0) <= 0:
        raise ConfigError(f"{model_config.model!r} is not a MoE model; fastdeploy_r3 serves MoE models only")
    dtype = torch_dtype(model_config.dtype)
    with torch.device(device):
        model = model_cls(hf, dtype, tp_rank, tp_size)
    if model_config.load_format == "dummy":
        # full-size tensors drawn identically on every rank, then sliced: shards of one model
        weights = random_weights(model, model_config.seed)
        model.load_weights(weights.items())
    else:
        model.load_weights(_iter_safetensors(_safetensors_files(model_config.model)))
    model.eval()
    model.requires_grad_(False)
    return model
