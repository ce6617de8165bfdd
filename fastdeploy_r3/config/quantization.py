"""What a checkpoint says about its quantization (config.json's `quantization_config`), read without torch.

    --quantization      the method the engine runs the weights with: "none" or "fp8"
    quantization_config {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}

"fp8" serves block-wise float8_e4m3fn weights with 128x128 float32 scales: a checkpoint saved that way
is read as is (and chosen without the flag, as vLLM and SGLang do), an unquantized one is quantized at
load. A checkpoint that was saved quantized in a way this engine cannot read (another method, block
size, format, or static activation scales) is refused here, before any process starts, naming it. The methods
themselves (how a layer creates, prepares and applies its weights) live in model_executor/quantization/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastdeploy_r3.errors import ConfigError

# --quantization choices: a method here has a QuantizationMethod pair in model_executor/quantization/
QUANTIZATION_METHODS = ("none", "fp8")


@dataclass(frozen=True)
class QuantizationConfig:
    """The checkpoint's quantization as config.json states it; method "none" when it states none."""

    method: str = "none"  # quant_method (HF key), lowercased
    fmt: str | None = None  # e.g. "e4m3" (fp8)
    weight_block_size: tuple[int, ...] | None = None  # block-wise scales, e.g. (128, 128)
    activation_scheme: str | None = None  # "dynamic" / "static"
    ignored_layers: tuple[str, ...] = ()  # modules left unquantized ("modules_to_not_convert" too)

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any]) -> QuantizationConfig:
        raw = hf_config.get("quantization_config")
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json's quantization_config is {type(raw).__name__}, not an object")
        method = raw.get("quant_method")
        if not isinstance(method, str) or not method:
            raise ConfigError(f"config.json's quantization_config has no quant_method (keys: {', '.join(sorted(raw))})")
        block = raw.get("weight_block_size")
        ignored = raw.get("ignored_layers") or raw.get("modules_to_not_convert") or ()
        return cls(
            method=method.lower(),
            fmt=raw.get("fmt"),
            weight_block_size=None if block is None else tuple(int(b) for b in block),
            activation_scheme=raw.get("activation_scheme"),
            ignored_layers=tuple(str(x) for x in ignored),
        )


def resolve_quantization(asked: str, checkpoint: QuantizationConfig, model: str) -> str:
    """The method the engine runs `model` with, given --quantization and the checkpoint's own config."""
    if asked not in QUANTIZATION_METHODS:
        raise ConfigError(f"quantization {asked!r} is not supported; use one of {', '.join(QUANTIZATION_METHODS)}")
    if checkpoint.method != "none" and checkpoint.method not in QUANTIZATION_METHODS:
        detail = ", ".join(f"{k}={v}" for k, v in (("fmt", checkpoint.fmt),
                                                    ("weight_block_size", checkpoint.weight_block_size)) if v)
        raise ConfigError(
            f"{model!r} is quantized with quant_method {checkpoint.method!r}"
            + (f" ({detail})" if detail else "")
            + f", which this engine does not support (quantization methods: {', '.join(QUANTIZATION_METHODS)}); "
            "serve the unquantized (bf16/fp16) checkpoint instead"
        )
    if checkpoint.method == "fp8":
        wrong = [f"{key}={value!r} (served: {want!r})" for key, value, want in (
            ("fmt", checkpoint.fmt or "e4m3", "e4m3"),
            ("weight_block_size", checkpoint.weight_block_size, (128, 128)),
            ("activation_scheme", checkpoint.activation_scheme or "dynamic", "dynamic"),
        ) if value != want]
        if wrong:
            raise ConfigError(f"{model!r} is an fp8 checkpoint with {', '.join(wrong)}; this engine serves block-wise "
                              "e4m3 weights with 128x128 scales and dynamic activations: serve the unquantized "
                              "checkpoint with --quantization fp8 instead")
        return "fp8"  # the checkpoint's scales need the fp8 method, asked for or not (vLLM and SGLang agree)
    return asked
