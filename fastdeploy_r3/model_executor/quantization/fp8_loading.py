"""Getting FP8 weights into a model: which layers hold them, and the stream every load goes through.

    quantize_layers(model, ignored)   after the model is built: every dense linear (q/k/v/o, gate/up/down,
                                      shared experts) and every routed expert gets the FP8 methods; router
                                      gates, norms, embeddings and lm_head are not method layers and stay
                                      in the model dtype (as in the published FP8 checkpoints)
    weight_stream(...)                 in front of MoeCausalLM.load_weights, for the initial load and every
                                      weight update: an fp8 weight is paired with its weight_scale_inv and
                                      passed on as is; a float weight of a quantized layer is quantized here
                                      (online quantization, the same blocks a pre-quantized checkpoint has)
    check_update_dtypes(...)           before a weight update changes anything: fp8 only where it belongs,
                                      every fp8 weight with its scale and every scale with its fp8 weight

Names are the checkpoint's (HF) names: X.weight and X.weight_scale_inv.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from fastdeploy_r3.errors import ConfigError, WeightLoadingError
from fastdeploy_r3.model_executor.quantization.fp8 import (
    BLOCK,
    FP8_DTYPE,
    SCALE_SUFFIX,
    Fp8LinearMethod,
    Fp8MoEMethod,
    quantize_blockwise,
    scale_shape,
)
from fastdeploy_r3.model_executor.quantization.unquantized import UnquantizedLinearMethod, UnquantizedMoEMethod

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # converted to float32 exactly


def _module_weight_names(model: nn.Module, module_name: str, module: nn.Module) -> list[str]:
    """The checkpoint names of the weights a method layer holds (stacked experts and q/k/v: several)."""
    to_ckpt = model._to_checkpoint_name  # type: ignore[operator]
    if isinstance(module.quant_method, UnquantizedMoEMethod):
        prefix = to_ckpt(module_name)
        return [f"{prefix}.{e}.{proj}.weight" for e in range(module.num_experts)  # type: ignore[attr-defined]
                for proj in model.expert_proj_names]  # type: ignore[attr-defined]
    if hasattr(module, "split_sizes"):  # QKVParallelLinear: HF keeps q_proj, k_proj, v_proj apart
        attn = to_ckpt(module_name.rsplit(".", 1)[0])
        return [f"{attn}.{shard}_proj.weight" for shard in ("q", "k", "v")]
    return [f"{to_ckpt(module_name)}.weight"]


def _ignored(weight_name: str, ignored_layers: Iterable[str]) -> bool:
    module = weight_name.removesuffix(".weight")
    return any(module == entry or module.startswith(entry + ".") for entry in ignored_layers)


def quantize_layers(model: nn.Module, ignored_layers: tuple[str, ...] = ()) -> frozenset[str]:
    """Give every dense linear and expert layer of `model` (built, not loaded) the FP8 methods; return the
    checkpoint names of the weights that are now fp8 (also kept as model.fp8_weight_names).

    ignored_layers: the checkpoint's modules_to_not_convert / ignored_layers (module names); a merged layer
    (q/k/v, an expert stack) is kept in the model dtype only when all of its parts are listed."""
    names: set[str] = set()
    for module_name, module in list(model.named_modules()):
        method = getattr(module, "quant_method", None)
        if not isinstance(method, (UnquantizedLinearMethod, UnquantizedMoEMethod)):
            continue
        weights = _module_weight_names(model, module_name, module)
        skipped = [_ignored(w, ignored_layers) for w in weights]
        if all(skipped):
            continue
        if any(skipped):
            raise ConfigError(f"the checkpoint leaves only some of {module_name!r}'s weights unquantized; this "
                              "engine stacks them in one layer, which must be all fp8 or all unquantized")
        tp_size = getattr(module, "tp_size", 1)
        if isinstance(method, UnquantizedMoEMethod):
            num_local, hidden = module.w13.shape[0], module.w13.shape[2]
            inter = module.intermediate_size
            if tp_size > 1 and inter % BLOCK:
                raise ConfigError(f"fp8 experts of {module_name!r}: the intermediate size per rank ({inter}) must "
                                  f"be a multiple of {BLOCK} under tensor parallelism (scale blocks)")
            module.quant_method = Fp8MoEMethod()
            module.quant_method.create_weights(module, num_local, hidden, inter)
        else:
            out_features, in_features = module.weight.shape
            if tp_size > 1 and getattr(module, "shard_dim", 0) == 1 and in_features % BLOCK:
                raise ConfigError(f"fp8 {module_name!r}: its input features per rank ({in_features}) must be a "
                                  f"multiple of {BLOCK} under tensor parallelism (scale blocks)")
            bias = module.bias
            module.quant_method = Fp8LinearMethod()
            module.quant_method.create_weights(module, in_features, out_features, bias is not None)
            module.bias = bias  # the model dtype's parameter, unchanged
        names.update(weights)
    frozen = frozenset(names)
    model.fp8_weight_names = frozen
    return frozen


def _checked_scale(name: str, scale: torch.Tensor, weight_shape: tuple[int, ...]) -> torch.Tensor:
    want = scale_shape(weight_shape)
    if tuple(scale.shape) != want:
        raise WeightLoadingError(f"scale {name!r} has shape {tuple(scale.shape)}; a {list(weight_shape)} weight in "
                             f"{BLOCK}x{BLOCK} blocks needs {list(want)}")
    if scale.dtype not in SCALE_DTYPES:
        raise WeightLoadingError(f"scale {name!r} is {str(scale.dtype).removeprefix('torch.')}; send float32 scales")
    scale = scale.float()
    if not bool(torch.isfinite(scale).all()):
        raise WeightLoadingError(f"scale {name!r} holds NaN or inf values")
    return scale


def weight_stream(
    weights: Iterable[tuple[str, torch.Tensor]],
    fp8_names: frozenset[str],
    expected: Mapping[str, tuple[int, ...]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors as load_weights routes them: every fp8-layer weight arrives as (fp8 weight, its
    checkpoint-layout float32 scale), one right after the other.

    An fp8 weight waits for its scale (and a scale for its weight); a float weight of an fp8 layer is
    quantized here; float8 anywhere else, or a weight or scale left without its partner, is refused."""
    waiting_weight: dict[str, torch.Tensor] = {}
    waiting_scale: dict[str, torch.Tensor] = {}
    for name, w in weights:
        base = name.removesuffix(SCALE_SUFFIX)
        if name in fp8_names:
            if tuple(w.shape) != expected.get(name):
                yield name, w  # load_weights names the shape it expects
            elif w.dtype == FP8_DTYPE:
                if name in waiting_scale:
                    yield name, w
                    yield name + SCALE_SUFFIX, waiting_scale.pop(name)
                else:
                    waiting_weight[name] = w
            elif w.dtype in FLOAT8_DTYPES:
                raise WeightLoadingError(f"weight {name!r} is {str(w.dtype).removeprefix('torch.')}; fp8 weights are "
                                         "float8_e4m3fn")
            else:
                codes, scale = quantize_blockwise(w)  # online quantization
                yield name, codes
                yield name + SCALE_SUFFIX, scale
        elif base != name and base in fp8_names:
            scale = _checked_scale(name, w, expected[base])
            if base in waiting_weight:
                yield base, waiting_weight.pop(base)
                yield name, scale
            else:
                waiting_scale[base] = scale
        else:
            if base in expected and (w.dtype in FLOAT8_DTYPES or base != name):
                raise WeightLoadingError(unquantized_layer_message(name, bool(fp8_names)))
            # unquantized, or a name the model lacks: load_weights checks it (GLM's MTP layers, fp8 or not, are
            # skipped there; anything else is an unexpected weight)
            yield name, w
    left = sorted(waiting_weight) + sorted(waiting_scale)
    if left:
        more = " (and others)" if len(left) > 1 else ""
        raise WeightLoadingError(f"fp8 weight {left[0]!r}{more} came without its pair (an fp8 weight needs its "
                                 "weight_scale_inv and a scale its fp8 weight)")


def unquantized_layer_message(name: str, quantized_model: bool) -> str:
    if not quantized_model:
        return (f"{name!r} is an fp8 weight or scale, but this engine runs quantization 'none'; start it with "
                "--quantization fp8 or send weights in the model dtype")
    return (f"{name!r} is an fp8 weight or scale of a layer that stays in the model dtype (router gates, norms, "
            "embeddings and lm_head are not quantized); send it in the model dtype")


def check_update_dtypes(
    dtypes: Mapping[str, torch.dtype], fp8_names: frozenset[str], expected: Mapping[str, tuple[int, ...]]
) -> None:
    """Refuse, before any weight changes, an update whose fp8 tensors cannot all land: fp8 on a layer that
    is not quantized, an fp8 weight without its scale among the same update, or a scale without its fp8
    weight. (A float weight alone is fine: it is quantized on arrival.) Names the model lacks (`expected`:
    its checkpoint_weight_shapes) are the model's check to skip or refuse."""
    for name, dtype in dtypes.items():
        base = name.removesuffix(SCALE_SUFFIX)
        if base not in expected:
            continue
        if base != name:
            if base not in fp8_names:
                raise WeightLoadingError(unquantized_layer_message(name, bool(fp8_names)))
            if dtypes.get(base) != FP8_DTYPE:
                raise WeightLoadingError(f"scale {name!r} came without its float8_e4m3fn weight {base!r} in the same "
                                     "update; send both, or the weight in the model dtype alone")
        elif dtype in FLOAT8_DTYPES:
            if name not in fp8_names:
                raise WeightLoadingError(unquantized_layer_message(name, bool(fp8_names)))
            if dtype != FP8_DTYPE:
                raise WeightLoadingError(f"weight {name!r} is {str(dtype).removeprefix('torch.')}; fp8 weights are "
                                     "float8_e4m3fn")
            if name + SCALE_SUFFIX not in dtypes:
                raise WeightLoadingError(f"fp8 weight {name!r} came without {name + SCALE_SUFFIX!r} in the same update")
