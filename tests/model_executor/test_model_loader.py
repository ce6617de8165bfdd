"""load_model(): safetensors (single and sharded), dummy weights, and the errors that name what is wrong."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from fake_model import make_fake_model
from safetensors.torch import load_file, save_file

from fastdeploy_r3.config import ConfigError, ModelConfig
from fastdeploy_r3.model_executor.forward_context import ForwardContext, set_forward_context
from fastdeploy_r3.model_executor.model_loader import load_model
from fastdeploy_r3.model_executor.models.base import WeightLoadingError
from fastdeploy_r3.model_executor.models.registry import get_model_class

CPU = torch.device("cpu")


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=None, kv_caches=[])):
        x = torch.tensor(ids)
        return model.compute_logits(model(x, torch.arange(len(ids))))


def test_loaded_model_is_eval_without_grad_and_has_r3_shape(fake_model_dir) -> None:
    mc = ModelConfig(model=fake_model_dir("glm4_moe"))
    model = load_model(mc, CPU)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model.moe_layer_ids == mc.moe_layer_ids == [1, 2, 3]  # first_k_dense_replace=1
    assert (model.num_experts, model.top_k, model.num_layers, model.num_kv_heads, model.head_dim) == (16, 4, 4, 2, 16)


def test_same_seed_gives_byte_identical_checkpoint(tmp_path) -> None:
    a = make_fake_model("mixtral", str(tmp_path / "a"), seed=3)
    b = make_fake_model("mixtral", str(tmp_path / "b"), seed=3)
    c = make_fake_model("mixtral", str(tmp_path / "c"), seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read(), name
    with open(os.path.join(a, "model.safetensors"), "rb") as fa, open(os.path.join(c, "model.safetensors"), "rb") as fc:
        assert fa.read() != fc.read()


def test_sharded_checkpoint_loads_like_single_file(fake_model_dir, tmp_path) -> None:
    src = fake_model_dir("qwen3_moe")
    dst = _copy(src, str(tmp_path / "sharded"))
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    os.remove(os.path.join(dst, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(dst, shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    single = load_model(ModelConfig(model=src), CPU)
    sharded = load_model(ModelConfig(model=dst), CPU)
    assert torch.equal(_logits(single, [1, 2, 3]), _logits(sharded, [1, 2, 3]))


def test_dummy_weights_are_seeded(fake_model_dir) -> None:
    d = fake_model_dir("qwen3_moe")
    m1 = load_model(ModelConfig(model=d, load_format="dummy", seed=1), CPU)
    m1b = load_model(ModelConfig(model=d, load_format="dummy", seed=1), CPU)
    m2 = load_model(ModelConfig(model=d, load_format="dummy", seed=2), CPU)
    assert torch.equal(_logits(m1, [5, 6]), _logits(m1b, [5, 6]))
    assert not torch.equal(_logits(m1, [5, 6]), _logits(m2, [5, 6]))


def test_tied_embeddings_load_without_lm_head(fake_model_dir, tmp_path) -> None:
    d = _copy(fake_model_dir("qwen3_moe"), str(tmp_path / "tied"))
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["tie_word_embeddings"] = True
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = load_file(os.path.join(d, "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, os.path.join(d, "model.safetensors"))
    model = load_model(ModelConfig(model=d), CPU)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_missing_expert_weight_is_named(fake_model_dir, tmp_path) -> None:
    d = _copy(fake_model_dir("mixtral"), str(tmp_path / "missing"))
    tensors = load_file(os.path.join(d, "model.safetensors"))
    del tensors["model.layers.2.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, os.path.join(d, "model.safetensors"))
    with pytest.raises(WeightLoadingError, match=r"model\.layers\.2\.block_sparse_moe\.experts\.5\.w3\.weight"):
        load_model(ModelConfig(model=d), CPU)


def test_unexpected_weight_is_named(fake_model_dir, tmp_path) -> None:
    d = _copy(fake_model_dir("qwen3_moe"), str(tmp_path / "extra"))
    tensors = load_file(os.path.join(d, "model.safetensors"))
    tensors["model.layers.0.mlp.experts.99.up_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, os.path.join(d, "model.safetensors"))
    with pytest.raises(WeightLoadingError, match=r"unexpected weight 'model\.layers\.0\.mlp\.experts\.99\.up_proj"):
        load_model(ModelConfig(model=d), CPU)


def test_wrong_shape_is_named(fake_model_dir, tmp_path) -> None:
    d = _copy(fake_model_dir("glm4_moe"), str(tmp_path / "shape"))
    tensors = load_file(os.path.join(d, "model.safetensors"))
    tensors["model.layers.1.mlp.gate.weight"] = torch.zeros(8, 64)
    save_file(tensors, os.path.join(d, "model.safetensors"))
    with pytest.raises(WeightLoadingError, match=r"'model\.layers\.1\.mlp\.gate\.weight' has shape \(8, 64\)"):
        load_model(ModelConfig(model=d), CPU)


def test_no_safetensors_says_what_to_do(fake_model_dir, tmp_path) -> None:
    d = _copy(fake_model_dir("qwen3_moe"), str(tmp_path / "empty"))
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(WeightLoadingError, match="no \\*.safetensors"):
        load_model(ModelConfig(model=d), CPU)


def test_unknown_architecture_is_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown architecture 'LlamaForCausalLM'"):
        get_model_class("LlamaForCausalLM")


def test_a_config_is_whole_and_frozen_once_built(fake_model_dir) -> None:
    """config.json is read at construction (no half-built ModelConfig reaches load_model), and nothing
    can be assigned to it afterwards."""
    mc = ModelConfig(model=fake_model_dir("qwen3_moe"))
    assert mc.architecture == "Qwen3MoeForCausalLM" and mc.num_experts > 0 and mc.hf_config
    with pytest.raises(dataclasses.FrozenInstanceError):
        mc.hf_config = {**mc.hf_config, "num_experts": 0}  # type: ignore[misc]


def test_bfloat16_model_keeps_glm_router_in_float32(fake_model_dir) -> None:
    model = load_model(ModelConfig(model=fake_model_dir("glm4_moe"), dtype="bfloat16"), CPU)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    logits = _logits(model, [1, 2, 3])
    assert logits.dtype == torch.float32 and logits.isfinite().all()
