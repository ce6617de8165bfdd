"""Build a model from a ModelConfig and fill it from *.safetensors (or random weights)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

import torch
from torch import nn

from fastdeploy_r3.config import ConfigError, ModelConfig, ParallelConfig
from fastdeploy_r3.config.dtypes import torch_dtype
from fastdeploy_r3.config.hf_config import num_routed_experts_from_hf_config
from fastdeploy_r3.config.parallel import read_expert_placement_file, trivial_physical_to_logical
from fastdeploy_r3.model_executor.batch_invariant import make_batch_invariant
from fastdeploy_r3.model_executor.layers.expert_load import ExpertLoadRecorder
from fastdeploy_r3.model_executor.layers.expert_placement import ExpertPlacement
from fastdeploy_r3.model_executor.models.base import WeightLoadingError
from fastdeploy_r3.model_executor.models.registry import get_model_class
from fastdeploy_r3.model_executor.quantization import (
    check_checkpoint_tensors,
    process_weights_after_loading,
    quantize_model,
)


def random_weight(
    name: str,
    shape: tuple[int, ...],
    generator: torch.Generator,
    router_std: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One deterministic random tensor on the generator's device, scaled by role.

    Router weights get a large std so that top-k scores have clear gaps (near-ties make routing
    oracles flaky); norms stay near 1 so activations keep their scale through the layers.
    """
    w = torch.randn(shape, generator=generator, device=generator.device, dtype=dtype)
    if name.endswith("e_score_correction_bias"):
        return w * 0.05
    if name.endswith("norm.weight"):
        return 1.0 + w * 0.1
    if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
        return w * router_std
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        return w * 0.5
    if name.endswith(".bias"):
        return w * 0.05
    return w * 0.08


def iter_random_weights(
    model: nn.Module,
    seed: int,
    router_std: float = 0.5,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random HF-named checkpoint tensors for `model`, one at a time, drawn on `device` in `dtype`.

    A pure function of (architecture, config, seed, device type, dtype): the draw order follows the sorted
    names, so every rank of a tensor-parallel group draws the same full tensors and keeps its slice.
    Drawn where they will live, a 30B model starts without 120 GB of float32 on the host.
    """
    generator = torch.Generator(device).manual_seed(seed)
    shapes = model.checkpoint_weight_shapes()
    # the policy's names first, then any draft (MTP) layer's: a model built with its draft layer draws the
    # same policy weights as one built without
    for name in sorted(shapes, key=lambda n: (model.is_draft_weight(n), n)):
        if not name.endswith("_scale_inv"):  # an fp8 model quantizes the drawn weights (the same draws)
            yield name, random_weight(name, shapes[name], generator, router_std, dtype)


def random_weights(model: nn.Module, seed: int, router_std: float = 0.5) -> dict[str, torch.Tensor]:
    """All of iter_random_weights on the CPU in float32 (what make_fake_model saves)."""
    return dict(iter_random_weights(model, seed, router_std))


def safetensors_files(model_dir: str) -> list[str]:
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


def safetensors_shapes(files: list[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the files and its shape, read from the headers (no tensor data)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def safetensors_names(files: list[str]) -> list[str]:
    """Every tensor name in the files, read from their headers (no tensor is loaded)."""
    from safetensors import safe_open

    names: list[str] = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            names.extend(f.keys())
    return names


def iter_safetensors(
    files: list[str], device: torch.device | str = "cpu", keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """One checkpoint tensor at a time, read straight onto `device` (the host holds no full copy).

    keep(name) False: the tensor is not read at all (another rank's experts).
    """
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if keep is None or keep(name):
                    yield name, f.get_tensor(name)


def expert_placement_for(
    parallel_config: ParallelConfig, model_config: ModelConfig, rank: int
) -> ExpertPlacement | None:
    """Rank `rank`'s experts: under expert parallelism a contiguous E/N of them, the slots of the EPLB
    placement file, or with R redundant experts the trivial E + R slots; else None (the identity)."""
    ep = parallel_config.expert_parallel_size
    if ep == 1:
        return None
    num_experts = num_routed_experts_from_hf_config(model_config.hf_config)
    if parallel_config.expert_placement_file is not None:
        p2l = read_expert_placement_file(parallel_config.expert_placement_file, num_experts, ep)
        return ExpertPlacement.redundant(p2l, num_experts, ep, rank)
    if parallel_config.ep_num_redundant_experts:
        p2l = trivial_physical_to_logical(num_experts, parallel_config.ep_num_redundant_experts)
        return ExpertPlacement.redundant(p2l, num_experts, ep, rank)
    return ExpertPlacement.contiguous(num_experts, ep, rank)


def expert_placements_of_ranks(
    parallel_config: ParallelConfig, model_config: ModelConfig
) -> list[ExpertPlacement] | None:
    """Every rank's placement (expert_placement_for), for a sender that delivers each rank only its experts;
    None without expert parallelism."""
    if parallel_config.expert_parallel_size == 1:
        return None
    return [expert_placement_for(parallel_config, model_config, r) for r in range(parallel_config.tensor_parallel_size)]


def load_model(
    model_config: ModelConfig,
    device: torch.device,
    tp_rank: int = 0,
    tp_size: int = 1,
    expert_placement: ExpertPlacement | None = None,
    with_draft_layers: bool = False,
) -> nn.Module:
    """Model of model_config's architecture on `device`, weights loaded, eval mode, grads off.

    With tp_size > 1 the model holds tensor-parallel rank tp_rank's shard of every split weight.
    expert_placement (the identity when None) says which routed experts this rank holds; the
    checkpoint's tensors of the others are never read. with_draft_layers: also the checkpoint's draft
    (MTP) layer, for MTP speculative decoding (GLM-4.5 only).
    """
    hf = model_config.hf_config
    arch = (hf.get("architectures") or [None])[0]
    model_cls = get_model_class(arch)
    if num_routed_experts_from_hf_config(hf) <= 0 or int(hf.get("num_experts_per_tok", 0) or 0) <= 0:
        raise ConfigError(f"{model_config.model!r} is not a MoE model; fastdeploy_r3 serves MoE models only")
    dtype = torch_dtype(model_config.dtype)
    prev_dtype = torch.get_default_dtype()
    # parameters are born in the model's dtype on the device: a float32 copy of a 30B model would not fit
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            draft = {"with_draft_layers": True} if with_draft_layers else {}  # only GLM takes it
            model = model_cls(hf, dtype, tp_rank, tp_size, expert_placement, **draft)
            # fp8 parameters replace the dense linears' and experts' before loading (biases: the model dtype)
            quantize_model(model, model_config.quantization, model_config.quantization_config.ignored_layers)
    finally:
        torch.set_default_dtype(prev_dtype)
    if model_config.load_format == "dummy":
        # full-size tensors drawn identically on every rank, then sliced: shards of one model. The CPU draws
        # float32 (the bytes make_fake_model saves), a GPU draws in the model's dtype, on the GPU.
        draw_dtype = dtype if device.type == "cuda" else torch.float32
        model.load_weights(iter_random_weights(model, model_config.seed, device=device, dtype=draw_dtype))
    else:
        files = safetensors_files(model_config.model)
        check_checkpoint_tensors(safetensors_names(files), model_config.quantization)
        model.load_weights(iter_safetensors(files, device, keep=model.holds_checkpoint_weight))
    process_weights_after_loading(model)
    if model_config.enable_deterministic_inference:
        make_batch_invariant(model)
    model.eval()
    model.requires_grad_(False)
    # counters every MoE layer adds its routed rows to while a record runs (layers/expert_load.py)
    model.expert_load = ExpertLoadRecorder(model)
    return model
