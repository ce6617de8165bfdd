"""What the parallel flags mean for a model: the sizes tensor parallelism splits, and expert parallelism.

    --tensor-parallel-size N                          attention, dense MLPs AND every expert split over N ranks
    --tensor-parallel-size N --enable-expert-parallel attention and dense MLPs split over N ranks; the routed
    --tensor-parallel-size N --ep-size N              experts are not split: each rank holds E/N whole experts

Expert parallelism runs over the tensor-parallel ranks (SGLang's `--tp N --ep N`, vLLM's
`--enable-expert-parallel` without data parallelism): its size is the TP size, nothing else yet.
"""

from __future__ import annotations

import math
from typing import Any

from fastdeploy_r3.config.hf_config import normalize_hf_config, num_routed_experts_from_hf_config
from fastdeploy_r3.errors import ConfigError


def expert_parallel_size(tensor_parallel_size: int, enable_expert_parallel: bool, ep_size: int) -> int:
    """The expert-parallel size the flags ask for (1: experts split on I by tensor parallelism)."""
    if ep_size < 1:
        raise ConfigError(f"ep_size={ep_size}; use at least 1")
    if ep_size > 1 and ep_size != tensor_parallel_size:
        raise ConfigError(
            f"ep_size={ep_size} differs from tensor_parallel_size={tensor_parallel_size}; expert parallelism runs "
            f"over the tensor-parallel ranks: use --ep-size {tensor_parallel_size} (or --enable-expert-parallel)"
        )
    return tensor_parallel_size if enable_expert_parallel or ep_size > 1 else 1


def validate_expert_parallel_flags(backend: str, ep: int, redundant: int, placement_file: str | None) -> None:
    """--moe-a2a-backend and --ep-num-redundant-experts (SGLang's flag): R extra physical expert slots, R/N
    per rank, that first hold replicas of experts 0..R-1 (physical slot p holds logical p mod E) and that a
    rebalance (/rebalance_experts) later gives to the experts the recorded load says are hottest."""
    validate_moe_a2a_backend(backend, ep)
    if redundant < 0:
        raise ConfigError(f"ep_num_redundant_experts={redundant}; use 0 or more")
    if redundant and ep == 1:
        raise ConfigError("ep_num_redundant_experts needs expert parallelism: add --enable-expert-parallel with a "
                          "tensor-parallel size of at least 2")
    if redundant % max(ep, 1):
        raise ConfigError(f"ep_num_redundant_experts={redundant} is not a multiple of the expert-parallel size {ep}: "
                          "every rank holds the same number of expert slots")
    if redundant and placement_file is not None:
        raise ConfigError("give either ep_num_redundant_experts or expert_placement_file: the file already says how "
                          "many physical slots there are")


def trivial_physical_to_logical(num_experts: int, redundant: int) -> tuple[int, ...]:
    """The placement before any load is known: physical slot p holds logical expert p mod E."""
    return tuple(p % num_experts for p in range(num_experts + redundant))


def validate_moe_a2a_backend(backend: str, ep: int) -> None:
    """--moe-a2a-backend: local (LocalDispatch) or alltoall (AllToAllDispatch, between expert-parallel ranks)."""
    if backend not in ("local", "alltoall"):
        raise ConfigError(f"moe_a2a_backend={backend!r}; use local or alltoall")
    if backend == "alltoall" and ep == 1:
        raise ConfigError("moe_a2a_backend='alltoall' dispatches tokens between expert-parallel ranks: add "
                          "--enable-expert-parallel with a tensor-parallel size of at least 2")


def validate_expert_parallel(hf: dict[str, Any], ep: int) -> None:
    """Every rank holds the same number of whole experts: ep must divide the routed expert count."""
    num_experts = num_routed_experts_from_hf_config(hf)
    if ep > 1 and num_experts % ep:
        choices = ", ".join(str(n) for n in range(1, num_experts + 1) if num_experts % n == 0)
        raise ConfigError(
            f"expert parallel size {ep} does not divide the {num_experts} routed experts; each rank holds an equal "
            f"contiguous share, so use a tensor/expert parallel size among: {choices}"
        )


def tensor_parallel_split_sizes(hf: dict[str, Any], expert_parallel: bool = False) -> dict[str, int]:
    """The config.json sizes tensor parallelism splits across ranks: attention by heads (GQA groups
    whole), dense MLPs and experts by intermediate size (GLM's shared experts are a multiple of
    moe_intermediate_size). Under expert parallelism the routed experts stay whole, so
    moe_intermediate_size is split only where shared experts (n_shared_experts x it) are."""
    num_heads = int(hf["num_attention_heads"])
    sizes = {"num_attention_heads": num_heads, "num_key_value_heads": int(hf.get("num_key_value_heads", num_heads))}
    shared = int(normalize_hf_config(hf).get("n_shared_experts") or 0)
    for key in ("moe_intermediate_size", "intermediate_size"):
        if hf.get(key):
            if key == "moe_intermediate_size" and expert_parallel:
                if shared:
                    sizes["shared_experts_intermediate_size"] = int(hf[key]) * shared
                continue
            sizes[key] = int(hf[key])
    return sizes


def validate_tensor_parallel(hf: dict[str, Any], tp: int, expert_parallel: bool) -> None:
    """Every size the ranks split (heads, kv heads, intermediate sizes) must divide evenly."""
    sizes = tensor_parallel_split_sizes(hf, expert_parallel)
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        g = math.gcd(*sizes.values())
        choices = ", ".join(str(n) for n in range(1, g + 1) if g % n == 0)
        raise ConfigError(
            f"tensor_parallel_size={tp} does not divide "
            + ", ".join(f"{k}={v}" for k, v in bad.items())
            + f"; the ranks split {', '.join(f'{k}={v}' for k, v in sizes.items())}, "
            f"so use one of: {choices}"
        )


def read_expert_placement_file(path: str, num_experts: int, ep: int) -> tuple[int, ...]:
    """EPLB's static placement: a JSON file {"physical_to_logical": [P ints]}, the logical expert of each
    physical slot, P/ep consecutive slots per rank, the same for every MoE layer; P >= E, every expert
    at least once (more than once: replicas of a hot expert)."""
    import json

    if ep < 2:
        raise ConfigError(f"expert_placement_file={path!r} needs expert parallelism: add --enable-expert-parallel "
                          "with a tensor-parallel size of at least 2")
    try:
        with open(path) as f:
            p2l = json.load(f)["physical_to_logical"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"expert_placement_file={path!r} could not be read as JSON with a 'physical_to_logical' "
                          f"list ({type(e).__name__})") from None
    if not isinstance(p2l, list) or not p2l or not all(isinstance(e, int) and not isinstance(e, bool) for e in p2l):
        raise ConfigError(f"expert_placement_file={path!r}: physical_to_logical must be a non-empty list of ints")
    if len(p2l) % ep:
        raise ConfigError(f"expert_placement_file={path!r} has {len(p2l)} physical slots, not a multiple of the "
                          f"expert-parallel size {ep}: every rank holds the same number of slots")
    bad = [e for e in p2l if not 0 <= e < num_experts]
    missing = sorted(set(range(num_experts)) - set(p2l))
    if bad or missing:
        what = (f"names expert {bad[0]}, outside [0, {num_experts})" if bad
                else f"holds no replica of expert {missing[0]}")
        raise ConfigError(f"expert_placement_file={path!r} {what}; list every logical expert at least once")
    return tuple(p2l)
