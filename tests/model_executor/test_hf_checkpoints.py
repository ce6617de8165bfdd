"""Checkpoints written by the installed transformers' save_pretrained (tests/hf_checkpoints.py) load as
transformers reads them: the config facts under v5's key names (Qwen3-MoE's num_local_experts, rope in
rope_parameters, dtype), exact MoE layer ids, GLM's draft layer skipped, and our forward equal to HF's
(logits within 1e-4, every MoE layer's router top-k identical) in float32 on CPU."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers
from hf_checkpoints import ENDOFTEXT_ID, EOS_ID, FAMILIES, GENERATION_DEFAULTS, MOE_LAYER_IDS, VOCAB_SIZE
from safetensors.torch import save_file

from fastdeploy_r3.config import ModelConfig
from fastdeploy_r3.model_executor.forward_context import ForwardContext, set_forward_context
from fastdeploy_r3.model_executor.model_loader import load_model
from fastdeploy_r3.model_executor.models.base import WeightLoadingError

# (num_experts, top_k, head_dim) of each family's checkpoint
SHAPES = {"qwen3_moe": (8, 2, 8), "mixtral": (8, 2, 8), "glm4_moe": (16, 4, 8)}
PROMPT = "Hello world! Tell me about the experts, 1234 ü 日本."


def test_v5_configs_use_the_aliases_the_engine_must_read(hf_checkpoint_dir) -> None:
    """What transformers v5 writes (the reason this module exists): no `num_experts` for Qwen3-MoE, no
    top-level rope_theta, `dtype` rather than `torch_dtype`."""
    raw = {f: json.load(open(os.path.join(hf_checkpoint_dir(f), "config.json"))) for f in FAMILIES}
    assert "num_experts" not in raw["qwen3_moe"] and raw["qwen3_moe"]["num_local_experts"] == 8
    assert raw["glm4_moe"]["n_routed_experts"] == 16
    assert all("rope_theta" not in c and "rope_parameters" in c for c in raw.values())
    assert all(c["dtype"] == "float32" and "torch_dtype" not in c for c in raw.values())
    assert raw["glm4_moe"]["rope_parameters"]["partial_rotary_factor"] == 0.5


@pytest.mark.parametrize("family", FAMILIES)
def test_model_config_reads_every_fact(hf_checkpoint_dir, family: str) -> None:
    mc = ModelConfig(model=hf_checkpoint_dir(family), dtype="auto")
    assert (mc.num_experts, mc.moe_top_k, mc.hf_config["head_dim"]) == SHAPES[family]
    assert mc.moe_layer_ids == MOE_LAYER_IDS[family]
    assert mc.dtype == "float32"  # from config.json's `dtype`
    assert mc.vocab_size == VOCAB_SIZE and mc.max_model_len == 256
    assert mc.eos_token_ids == [EOS_ID, ENDOFTEXT_ID]  # config.json's, then generation_config.json's
    assert mc.generation_defaults == GENERATION_DEFAULTS
    assert mc.hf_config["tie_word_embeddings"] is (family == "mixtral")


class _Pair:
    """Our model and transformers' from the same directory, float32."""

    def __init__(self, model_dir: str) -> None:
        self.mc = ModelConfig(model=model_dir, dtype="float32")
        self.ours = load_model(self.mc, torch.device("cpu"))
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: pytest.FixtureRequest, hf_checkpoint_dir) -> _Pair:
    return _Pair(hf_checkpoint_dir(request.param))


def hf_router_topk(hf_model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """HF logits [T, V] and {layer id: router top-k ids [T, K]} from forward hooks on each MoE block's gate
    (transformers v5's <Family>TopKRouter returns (logits, weights, ids), each family's own top-k rule)."""
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for name, module in hf_model.named_modules():
        if name.endswith(".mlp.gate") and type(module).__name__.lower().endswith("topkrouter"):
            layer = int(name.split(".")[2])
            handles.append(module.register_forward_hook(lambda m, a, out, i=layer: captured.__setitem__(i, out[2])))
    try:
        with torch.no_grad():
            logits = hf_model(ids[None]).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    return logits, captured


def test_logits_and_router_topk_equal_hf(pair: _Pair, new_routing_sink) -> None:
    ids = torch.tensor(pair.tokenizer(PROMPT)["input_ids"], dtype=torch.int64)
    ref_logits, ref_topk = hf_router_topk(pair.hf, ids)
    assert sorted(ref_topk) == pair.mc.moe_layer_ids  # HF's own MoE layers, the draft layer not among them
    sink = new_routing_sink()
    with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=None, kv_caches=[], routing_capture=sink)):
        logits = pair.ours.compute_logits(pair.ours(ids, torch.arange(len(ids))))
    assert ((logits - ref_logits).norm() / ref_logits.norm()).item() < 1e-4
    ours = sink.per_layer(len(pair.mc.moe_layer_ids))
    for moe_index, layer in enumerate(pair.mc.moe_layer_ids):
        a = ours[moe_index].sort(dim=-1).values.long()
        b = ref_topk[layer].sort(dim=-1).values.long()
        assert torch.equal(a, b), f"layer {layer}: tokens {(a != b).any(-1).nonzero().flatten().tolist()} differ"


def test_glm_draft_layer_weights_are_skipped_and_a_layer_past_them_is_not(hf_checkpoint_dir, tmp_path) -> None:
    """The checkpoint's index names model.layers.4.* (num_nextn_predict_layers=1 after 4 decoder layers):
    loading skips them; a tensor of layer 5 is neither a decoder nor a draft layer and is refused."""
    src = hf_checkpoint_dir("glm4_moe")
    index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
    assert "model.layers.4.eh_proj.weight" in index["weight_map"]
    model = load_model(ModelConfig(model=src), torch.device("cpu"))
    assert not any(".layers.4." in name for name in model.state_dict())

    bad = str(tmp_path / "glm")
    shutil.copytree(src, bad)
    save_file({"model.layers.5.enorm.weight": torch.ones(32)}, os.path.join(bad, "model-extra.safetensors"))
    index["weight_map"]["model.layers.5.enorm.weight"] = "model-extra.safetensors"
    with open(os.path.join(bad, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with pytest.raises(WeightLoadingError, match=r"unexpected weight 'model\.layers\.5\.enorm\.weight'"):
        load_model(ModelConfig(model=bad), torch.device("cpu"))
