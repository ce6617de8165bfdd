"""Real-shape presets: config.json with the published architecture, a tokenizer of the same vocabulary,
no weights; the engine builds the model from them (here cut to one layer, on the meta device)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fastdeploy_r3.model_executor.models.registry import get_model_class
from tools.model_presets import preset_config, write_preset


def test_qwen3_30b_a3b_has_the_published_shape() -> None:
    hf = preset_config("qwen3-30b-a3b")
    assert (hf["hidden_size"], hf["num_hidden_layers"]) == (2048, 48)
    assert (hf["num_experts"], hf["num_experts_per_tok"]) == (128, 8)
    assert (hf["moe_intermediate_size"], hf["num_attention_heads"], hf["num_key_value_heads"]) == (768, 32, 4)
    assert (hf["head_dim"], hf["vocab_size"]) == (128, 151936)
    assert hf["eos_token_id"] == 151935  # <|im_end|>, the last token of the written tokenizer


def test_write_preset_mixtral_cut_to_two_layers(tmp_path: Path) -> None:
    """--layers 2: config says 2 layers; tokenizer vocabulary == vocab_size; no *.safetensors written."""
    out = write_preset("mixtral-8x7b", str(tmp_path / "mixtral"), num_layers=2)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "tokenizer.json",
                                       "tokenizer_config.json"]
    with open(os.path.join(out, "config.json")) as f:
        hf = json.load(f)
    assert (hf["num_hidden_layers"], hf["num_local_experts"], hf["num_experts_per_tok"]) == (2, 8, 2)
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(os.path.join(out, "tokenizer.json")).get_vocab_size() == 32000


def test_glm_45_air_builds_with_its_dense_first_layer() -> None:
    """GLM-4.5-Air cut to 2 layers, on the meta device: layer 0 dense, layer 1 MoE with 128 experts x 1408."""
    hf = preset_config("glm-4.5-air", num_layers=2)
    with torch.device("meta"):
        model = get_model_class(hf["architectures"][0])(hf, torch.bfloat16)
    assert model.moe_layer_ids == [1]
    experts = model.model.layers[1].mlp.experts
    assert tuple(experts.w13.shape) == (128, 2 * 1408, 4096)
    assert model.model.layers[1].mlp.shared_experts is not None


def test_the_expert_parallel_presets_split_their_experts_whole() -> None:
    """Qwen3-235B-A22B (128 experts, 4 kv heads: TP=EP=4) and GLM-4.5 (160 experts, 8 kv heads: TP=EP=8) pass
    the expert-parallel checks; each rank of a 2-layer GLM-4.5 on the meta device holds 20 whole experts."""
    from fastdeploy_r3.config import ParallelConfig
    from fastdeploy_r3.model_executor.layers.expert_placement import ExpertPlacement

    qwen, glm = preset_config("qwen3-235b-a22b"), preset_config("glm-4.5", num_layers=4)
    assert (qwen["num_hidden_layers"], qwen["hidden_size"], qwen["num_experts"]) == (94, 4096, 128)
    assert (glm["n_routed_experts"], glm["first_k_dense_replace"], glm["routed_scaling_factor"]) == (160, 3, 2.5)
    ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True).validate_for_model(qwen)
    ParallelConfig(tensor_parallel_size=8, ep_size=8).validate_for_model(glm)
    with torch.device("meta"):
        model = get_model_class(glm["architectures"][0])(glm, torch.bfloat16, 7, 8,
                                                         ExpertPlacement.contiguous(160, 8, 7))
    assert model.moe_layer_ids == [3]
    experts = model.model.layers[3].mlp.experts
    assert tuple(experts.w13.shape) == (20, 2 * 1536, 5120)
    assert experts.placement.local_experts == tuple(range(140, 160))


def test_save_hf_checkpoint_writes_weights_transformers_initialised_and_reloads(tmp_path: Path,
                                                                                  monkeypatch) -> None:  # noqa: ANN001
    """tools/mismatch.py --preset's checkpoint: the preset's files plus the weights transformers' own init
    draws (seed 0), written by save_pretrained; here a shrunken Qwen3-MoE preset cut to 2 layers."""
    import transformers

    from tools import model_presets

    tiny = dict(model_presets.MODEL_PRESETS["qwen3-30b-a3b"], hidden_size=64, intermediate_size=128,
                moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=8, num_experts_per_tok=2, vocab_size=1024)  # fmt: skip
    monkeypatch.setitem(model_presets.MODEL_PRESETS, "tiny-qwen3", tiny)
    first = model_presets.save_hf_checkpoint("tiny-qwen3", str(tmp_path / "a"), num_layers=2)
    second = model_presets.save_hf_checkpoint("tiny-qwen3", str(tmp_path / "b"), num_layers=2)
    assert any(name.endswith(".safetensors") for name in os.listdir(first))
    a = transformers.AutoModelForCausalLM.from_pretrained(first)
    b = transformers.AutoModelForCausalLM.from_pretrained(second)
    assert a.config.num_hidden_layers == 2 and a.config.num_experts == 8 and a.config.vocab_size == 1024
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)  # seed 0: the same draw each time
    assert all(t.dtype == torch.bfloat16 for t in state_a.values())
    assert len(transformers.AutoTokenizer.from_pretrained(first)) == 1024  # special tokens included
