"""The quantization seam: 'none' and 'fp8' (tests/model_executor/test_fp8.py), checkpoints that need another
are refused by name, the KV cache dtype is its own setting, and every large layer goes through its method."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from fastdeploy_r3.config import ConfigError, EngineConfig, ModelConfig
from fastdeploy_r3.config.quantization import QuantizationConfig
from fastdeploy_r3.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from fastdeploy_r3.model_executor.model_loader import load_model
from fastdeploy_r3.model_executor.quantization import process_weights_after_loading
from fastdeploy_r3.model_executor.quantization.unquantized import UnquantizedLinearMethod, UnquantizedMoEMethod

CPU = torch.device("cpu")
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _copy_with_config(src: str, dst: str, **config_keys: object) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, **config_keys}, f)
    return dst


def test_an_fp8_checkpoint_selects_fp8_and_other_fp8_layouts_are_refused_naming_them(fake_model_dir, tmp_path) -> None:
    """The published block-wise layout is served with or without the flag (as vLLM and SGLang read it); an
    fp8 checkpoint this engine cannot read (per-tensor scales, static activations, e5m2) says so by key."""
    d = _copy_with_config(fake_model_dir("qwen3_moe"), str(tmp_path / "fp8"), quantization_config=FP8_CONFIG)
    assert ModelConfig(model=d).quantization == ModelConfig(model=d, quantization="fp8").quantization == "fp8"
    for key, value, shown in (("weight_block_size", None, "weight_block_size=None"),
                              ("activation_scheme", "static", "activation_scheme='static'"),
                              ("fmt", "e5m2", "fmt='e5m2'")):
        bad = _copy_with_config(d, str(tmp_path / key), quantization_config={**FP8_CONFIG, key: value})
        with pytest.raises(ConfigError, match=rf"is an fp8 checkpoint with {re.escape(shown)} \(served: .*serve the "
                                              r"unquantized checkpoint with --quantization fp8 instead"):
            ModelConfig(model=bad)
    awq = _copy_with_config(d, str(tmp_path / "awq"), quantization_config={"quant_method": "awq"})
    with pytest.raises(ConfigError, match=r"quantized with quant_method 'awq', which this engine does not support "
                                          r"\(quantization methods: none, fp8\)"):
        ModelConfig(model=awq)


def test_the_checkpoint_quantization_config_is_read_into_a_frozen_config(fake_model_dir) -> None:
    assert QuantizationConfig.from_hf({"quantization_config": {**FP8_CONFIG, "ignored_layers": ["lm_head"]}}) == \
        QuantizationConfig("fp8", "e4m3", (128, 128), "dynamic", ("lm_head",))
    mc = ModelConfig(model=fake_model_dir("qwen3_moe"))
    assert (mc.quantization, mc.quantization_config) == ("none", QuantizationConfig())
    with pytest.raises(ConfigError, match="has no quant_method"):
        QuantizationConfig.from_hf({"quantization_config": {"fmt": "e4m3"}})


def test_a_quantization_flag_other_than_none_or_fp8_is_refused(fake_model_dir) -> None:
    with pytest.raises(ConfigError, match=r"quantization 'int8' is not supported; use one of none, fp8"):
        ModelConfig(model=fake_model_dir("qwen3_moe"), quantization="int8")


def test_scale_tensors_without_a_quantization_config_are_refused_by_name(fake_model_dir, tmp_path) -> None:
    """A checkpoint carrying fp8 block scales but no quantization_config: the loader names the scales
    rather than failing on an 'unexpected weight' (or running quantized bytes as plain weights)."""
    d = str(tmp_path / "scales")
    shutil.copytree(fake_model_dir("qwen3_moe"), d)
    tensors = load_file(os.path.join(d, "model.safetensors"))
    tensors["model.layers.0.mlp.experts.0.down_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, os.path.join(d, "model.safetensors"))
    with pytest.raises(ConfigError, match=r"quantization tensors \(model\.layers\.0\.mlp\.experts\.0\.down_proj\."
                                          r"weight_scale_inv\) that quantization 'none' cannot read"):
        load_model(ModelConfig(model=d), CPU)


def test_kv_cache_dtype_is_the_model_dtype_unless_set_and_only_that_for_now(fake_model_dir) -> None:
    d = fake_model_dir("qwen3_moe")
    cfg = EngineConfig.from_kwargs(d, dtype="bfloat16", device="cpu")
    assert (cfg.model_config.dtype, cfg.cache_config.kv_cache_dtype) == ("bfloat16", "bfloat16")
    assert EngineConfig.from_kwargs(d, dtype="float32", kv_cache_dtype="float32", device="cpu") \
        .cache_config.kv_cache_dtype == "float32"
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='float16' differs from the model dtype 'float32'"):
        EngineConfig.from_kwargs(d, dtype="float32", kv_cache_dtype="float16", device="cpu")


class CountingLinearMethod(UnquantizedLinearMethod):
    """Plain weights, counting what the layer asks of its method."""

    def __init__(self) -> None:
        self.created, self.applied, self.processed = 0, 0, 0

    def create_weights(self, layer: torch.nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        self.created += 1
        super().create_weights(layer, in_features, out_features, bias)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        self.applied += 1
        return super().apply(layer, x, bias)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.processed += 1


def test_linear_layers_create_and_apply_their_weights_through_the_method() -> None:
    """The hook FP8 will use: a method passed to a layer makes its parameters and runs its forward."""
    col, row = CountingLinearMethod(), CountingLinearMethod()
    up = ColumnParallelLinear(8, 6, bias=True, quant_method=col)
    down = RowParallelLinear(6, 8, quant_method=row)
    model = torch.nn.Sequential(up, down)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(3, 8)
    want = F.linear(F.linear(x, up.weight, up.bias), down.weight)
    assert torch.equal(model(x), want)
    process_weights_after_loading(model)
    assert (col.created, col.applied, col.processed) == (1, 1, 1)
    assert (row.created, row.applied, row.processed) == (1, 1, 1)
    assert [name for name, _ in model.named_parameters()] == ["0.weight", "0.bias", "1.weight"]


def test_a_loaded_model_runs_every_large_layer_through_the_unquantized_method(fake_model_dir) -> None:
    model = load_model(ModelConfig(model=fake_model_dir("qwen3_moe")), CPU)
    kinds = {type(m).__name__: type(m.quant_method) for m in model.modules() if hasattr(m, "quant_method")}
    assert kinds == {
        "QKVParallelLinear": UnquantizedLinearMethod,
        "RowParallelLinear": UnquantizedLinearMethod,
        "StackedExperts": UnquantizedMoEMethod,
    }
