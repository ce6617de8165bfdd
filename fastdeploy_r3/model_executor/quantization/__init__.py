"""The quantization seam: which method a layer's weights go through, and checkpoints we cannot serve.

    base.py         QuantizationMethod (create_weights / process_weights_after_loading / apply),
                    LinearMethod and MoEMethod, the two layer kinds that hold large weights
    unquantized.py  the methods of "none": weights in the model dtype, F.linear and the MoE kernels
    fp8.py          the methods of "fp8": block-wise float8_e4m3fn weights with 128x128 scales
    fp8_loading.py  which layers become fp8, and the stream every load and weight update goes through

The method's name comes from ModelConfig.quantization (--quantization, checked against the
checkpoint's quantization_config by config/quantization.py). FP8 is a new pair of methods registered in
METHODS, not a change to the layers: the model is built unquantized, and quantize_model swaps the
methods (and parameters) of its dense linears and experts before any weight is loaded.
This room is part of model_executor/: it imports torch and
config/, never cache_manager/ or engine/.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from fastdeploy_r3.errors import ConfigError
from fastdeploy_r3.model_executor.quantization.base import LinearMethod, MoEMethod, QuantizationMethod
from fastdeploy_r3.model_executor.quantization.fp8 import Fp8LinearMethod, Fp8MoEMethod
from fastdeploy_r3.model_executor.quantization.fp8_loading import quantize_layers
from fastdeploy_r3.model_executor.quantization.unquantized import UnquantizedLinearMethod, UnquantizedMoEMethod

__all__ = [
    "LinearMethod",
    "MoEMethod",
    "QuantizationMethod",
    "check_checkpoint_tensors",
    "linear_method",
    "moe_method",
    "process_weights_after_loading",
    "quantize_model",
]

# method name -> (linear method, MoE method) classes
METHODS: dict[str, tuple[type[LinearMethod], type[MoEMethod]]] = {
    "none": (UnquantizedLinearMethod, UnquantizedMoEMethod),
    "fp8": (Fp8LinearMethod, Fp8MoEMethod),
}

# tensor-name endings of quantized checkpoints (fp8 block / per-tensor scales, int zero points)
_SCALE_SUFFIXES = ("_scale_inv", ".weight_scale", ".input_scale", ".qweight", ".qzeros", ".scales")


def _methods(name: str) -> tuple[type[LinearMethod], type[MoEMethod]]:
    if name not in METHODS:
        raise ConfigError(f"quantization {name!r} has no method; use one of {', '.join(METHODS)}")
    return METHODS[name]


def linear_method(name: str = "none") -> LinearMethod:
    return _methods(name)[0]()


def moe_method(name: str = "none") -> MoEMethod:
    return _methods(name)[1]()


def check_checkpoint_tensors(names: Iterable[str], method: str = "none") -> None:
    """Refuse a checkpoint whose tensors carry quantization scales when `method` reads none: loading
    would either fail on a name the model lacks or, worse, run the quantized bytes as plain weights."""
    names = list(names)
    found = sorted(n for n in names if n.endswith(_SCALE_SUFFIXES))
    if method == "fp8":  # weight_scale_inv is read; per-tensor fp8 scales and int formats are not
        found = [n for n in found if not n.endswith("_scale_inv")]
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise ConfigError(
            f"the checkpoint holds quantization tensors ({', '.join(found[:3])}{more}) that quantization "
            f"{method!r} cannot read (block-wise fp8 with weight_scale_inv is read by --quantization fp8; "
            "per-tensor fp8 and int checkpoints are not supported); serve the unquantized checkpoint"
        )


def quantize_model(model: nn.Module, method: str, ignored_layers: tuple[str, ...] = ()) -> None:
    """Give a freshly built (unloaded) model's dense linears and experts `method`'s parameters."""
    _methods(method)
    if method == "fp8":
        quantize_layers(model, ignored_layers)


def process_weights_after_loading(model: nn.Module) -> None:
    """Give every layer's method its once-after-loading pass (a no-op for unquantized weights)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizationMethod):
            method.process_weights_after_loading(module)
