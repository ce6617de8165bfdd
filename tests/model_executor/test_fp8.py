"""Block-wise FP8 weights on the CPU (model_executor/quantization/fp8.py, fp8_loading.py), per family:

    the fake checkpoint's published layout -> the FP8 model's logits == dequantise-then-matmul, exactly
    a bf16 checkpoint quantized at load   == the pre-quantized checkpoint of the same weights, byte for byte
    the FP8 model vs the unquantized one: logits within a stated tolerance (relative RMS below 10 %;
                                          measured 0.03-0.06 on these 4-layer models, GLM the largest)

Weight updates onto an fp8 engine are in tests/worker/test_fp8_weight_update.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from fake_model import make_fake_model
from safetensors import safe_open

from fastdeploy_r3.config import ModelConfig
from fastdeploy_r3.model_executor.forward_context import ForwardContext, set_forward_context
from fastdeploy_r3.model_executor.model_loader import load_model
from fastdeploy_r3.model_executor.quantization.fp8 import FP8_DTYPE, quantize_blockwise

CPU = torch.device("cpu")
ARCHS = ("qwen3_moe", "glm4_moe", "mixtral")
PROMPT = torch.tensor([3, 17, 250, 9, 400, 77, 120, 5, 64, 311])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """arch -> (bf16 checkpoint, the fp8 checkpoint quantized from exactly those bf16 weights)."""
    root = tmp_path_factory.mktemp("fp8")
    return {arch: (make_fake_model(arch, str(root / f"{arch}-bf16"), dtype="bfloat16"),
                   make_fake_model(arch, str(root / f"{arch}-fp8"), dtype="bfloat16", fp8=True)) for arch in ARCHS}


def _tensors(model_dir: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=None, kv_caches=[])):
        return model.compute_logits(model(PROMPT, torch.arange(len(PROMPT))))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _dequantised_by_hand(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w[o, i] = code[o, i] * scale[o // 128, i // 128], element by element over the blocks (the test's own)."""
    w = torch.empty(codes.shape, dtype=torch.float32)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            rows, cols = slice(128 * r, 128 * (r + 1)), slice(128 * c, 128 * (c + 1))
            w[rows, cols] = codes[rows, cols].float() * scale[r, c]
    return w


def test_blockwise_quantization_of_a_shape_with_partial_edge_blocks() -> None:
    w = torch.randn(200, 130, generator=torch.Generator().manual_seed(0)) * 0.1
    w[128:, 128:] = 0.0  # an all-zero (partial) block
    codes, scale = quantize_blockwise(w)
    assert (codes.dtype, tuple(codes.shape), scale.dtype, tuple(scale.shape)) == (FP8_DTYPE, (200, 130),
                                                                                   torch.float32, (2, 2))
    # each block's largest |w| maps to the largest code, 448, and every scale is that amax / 448
    for r, c in ((0, 0), (0, 1), (1, 0)):
        block = w[128 * r : 128 * (r + 1), 128 * c : 128 * (c + 1)]
        assert scale[r, c] == block.abs().max() / 448
        assert codes[128 * r : 128 * (r + 1), 128 * c : 128 * (c + 1)].float().abs().max() == 448
    assert scale[1, 1] > 0 and not codes[128:, 128:].float().any()
    back = _dequantised_by_hand(codes, scale)
    assert ((back - w).abs() <= w.abs() / 16 + 1e-3 * scale.max()).all()  # e4m3: 3 mantissa bits
    assert torch.equal(_bytes(quantize_blockwise(w.bfloat16().float())[0]), _bytes(quantize_blockwise(w.bfloat16())[0]))


@pytest.mark.parametrize("arch", ARCHS)
def test_the_fp8_checkpoint_has_the_published_layout(checkpoints, arch: str) -> None:
    """Dense linears and experts fp8 with [ceil(O/128), ceil(I/128)] float32 scales; router gates, norms,
    embeddings and lm_head in the checkpoint dtype (as Qwen3-30B-A3B-FP8 keeps them)."""
    bf16, fp8 = (_tensors(d) for d in checkpoints[arch])
    scales = {n for n in fp8 if n.endswith("_scale_inv")}
    assert {n.removesuffix("_scale_inv") for n in scales} | set(bf16) == set(fp8) - scales
    moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
    down = "w2" if arch == "mixtral" else "down_proj"
    for name, w in fp8.items():
        if name.endswith("_scale_inv"):
            weight = fp8[name.removesuffix("_scale_inv")]
            assert (weight.dtype, w.dtype) == (FP8_DTYPE, torch.float32), name
            assert tuple(w.shape) == (-(-weight.shape[0] // 128), -(-weight.shape[1] // 128)), name
            assert torch.equal(_bytes(weight), _bytes(quantize_blockwise(bf16[name.removesuffix("_scale_inv")])[0]))
        elif name + "_scale_inv" not in fp8:
            assert w.dtype == torch.bfloat16 and torch.equal(w, bf16[name]), name
    kept = {n for n in fp8 if n + "_scale_inv" not in fp8 and not n.endswith("_scale_inv")}
    assert {"lm_head.weight", "model.embed_tokens.weight", f"model.layers.1.{moe}.gate.weight",
            "model.layers.1.input_layernorm.weight"} <= kept
    assert {f"model.layers.1.{moe}.experts.3.{down}.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.o_proj.weight"} <= set(fp8) - kept - scales
    if arch == "glm4_moe":  # the dense first layer and the shared experts are dense linears
        assert {"model.layers.0.mlp.gate_proj.weight_scale_inv",
                "model.layers.1.mlp.shared_experts.down_proj.weight_scale_inv"} <= scales


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_logits_are_dequantise_then_matmul_exactly_and_near_the_unquantized_model(checkpoints, arch: str) -> None:
    bf16_dir, fp8_dir = checkpoints[arch]
    mc = ModelConfig(model=fp8_dir)  # quantization_config selects fp8 by itself
    assert mc.quantization == "fp8"
    fp8 = load_model(mc, CPU)
    reference = load_model(ModelConfig(model=bf16_dir), CPU)  # unquantized, float32 compute
    unquantized = _logits(reference)
    tensors = _tensors(fp8_dir)
    dequantised = [(name, _dequantised_by_hand(w, tensors[name + "_scale_inv"])) for name, w in tensors.items()
                   if name + "_scale_inv" in tensors]
    assert len(dequantised) == len(fp8.fp8_weight_names) > 0
    reference.load_weights(dequantised, strict=False)  # the same model with the dequantised weights
    want = _logits(reference)
    got = _logits(fp8)
    assert torch.equal(got, want)  # same ops on the same values
    # and against the unquantized model: fp8 e4m3 keeps 3 mantissa bits (per-weight error <= 1/16 relative)
    rel_rms = ((got - unquantized).norm() / unquantized.norm()).item()
    print(f"{arch}: relative RMS of fp8 - unquantized logits {rel_rms:.4f}")
    assert rel_rms < 0.1, rel_rms


@pytest.mark.parametrize("arch", ARCHS)
def test_a_bf16_checkpoint_quantized_at_load_equals_the_prequantized_checkpoint(checkpoints, arch: str) -> None:
    bf16_dir, fp8_dir = checkpoints[arch]
    online = load_model(ModelConfig(model=bf16_dir, quantization="fp8"), CPU)
    stored = load_model(ModelConfig(model=fp8_dir), CPU)
    a, b = online.state_dict(), stored.state_dict()
    assert list(a) == list(b)
    fp8_params = [name for name, t in a.items() if t.dtype == FP8_DTYPE]
    assert len(fp8_params) > 0 and all(name.replace("weight", "weight_scale_inv") in a or
                                       name + "_weight_scale_inv" in a for name in fp8_params)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(_bytes(a[name]), _bytes(b[name])), name


def test_the_prefix_cache_identity_names_the_quantization(checkpoints) -> None:
    from fastdeploy_r3.cache_manager.block_hash import root_hash

    bf16_dir, fp8_dir = checkpoints["qwen3_moe"]
    plain, quantized = ModelConfig(model=bf16_dir), ModelConfig(model=bf16_dir, quantization="fp8")
    assert plain.model_identity.endswith(":float32") and quantized.model_identity == plain.model_identity + ":fp8"
    assert root_hash(plain.model_identity, "0") != root_hash(quantized.model_identity, "0")
    assert ModelConfig(model=fp8_dir).model_identity.endswith(":fp8")


def test_modules_the_checkpoint_leaves_unconverted_stay_in_the_model_dtype(checkpoints, tmp_path) -> None:
    """quantization_config's modules_to_not_convert (ignored_layers) names modules kept unquantized; a merged
    layer (q/k/v here) cannot be split between fp8 and not, and says so."""
    import json
    import shutil

    from safetensors.torch import save_file

    from fastdeploy_r3.config import ConfigError

    bf16_dir, fp8_dir = checkpoints["qwen3_moe"]
    o_proj = "model.layers.0.self_attn.o_proj"

    def variant(name: str, ignored: list[str]) -> str:
        d = str(tmp_path / name)
        shutil.copytree(fp8_dir, d)
        tensors = _tensors(d)
        tensors[f"{o_proj}.weight"] = _tensors(bf16_dir)[f"{o_proj}.weight"]
        del tensors[f"{o_proj}.weight_scale_inv"]
        save_file(tensors, os.path.join(d, "model.safetensors"))
        with open(os.path.join(d, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"]["modules_to_not_convert"] = ignored
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        return d

    model = load_model(ModelConfig(model=variant("o_proj", ["lm_head", o_proj])), CPU)
    layer = model.model.layers[0].self_attn.o_proj
    assert layer.weight.dtype == torch.float32 and not hasattr(layer, "weight_scale_inv")
    assert torch.equal(layer.weight, _tensors(bf16_dir)[f"{o_proj}.weight"].float())
    assert f"{o_proj}.weight" not in model.fp8_weight_names
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8_DTYPE
    with pytest.raises(ConfigError, match=r"leaves only some of 'model.layers.0.self_attn.qkv_proj'"):
        load_model(ModelConfig(model=variant("q_only", [o_proj, "model.layers.0.self_attn.q_proj"])), CPU)


def test_tensor_parallel_fp8_needs_whole_scale_blocks_per_rank(checkpoints) -> None:
    """A row-parallel shard (o_proj / down_proj, the experts' I) cuts the input dimension, which the scale
    blocks tile by 128: the tiny model's 64 / 2 = 32 columns per rank cannot be served, and says what to change."""
    from fastdeploy_r3.config import ConfigError

    with pytest.raises(ConfigError, match=r"per rank \(32\) must be a multiple of 128 under tensor parallelism"):
        load_model(ModelConfig(model=checkpoints["qwen3_moe"][1]), CPU, tp_rank=0, tp_size=2)


def test_glm_draft_layers_of_an_fp8_checkpoint_are_skipped_fp8_or_not(checkpoints, tmp_path) -> None:
    """GLM-4.5-FP8 stores its multi-token-prediction layer quantized too; this engine never loads it, so its
    fp8 weights and scales are skipped like its other tensors instead of refused as fp8 on an unknown layer."""
    import json
    import shutil

    from safetensors.torch import save_file

    d = str(tmp_path / "mtp")
    shutil.copytree(checkpoints["glm4_moe"][1], d)
    tensors = _tensors(d)
    mtp = "model.layers.4.mlp.experts.0.down_proj.weight"  # layer 4 of a 4-layer model: the draft layer
    tensors[mtp], tensors[mtp + "_scale_inv"] = quantize_blockwise(torch.ones(64, 32))
    tensors["model.layers.4.input_layernorm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    save_file(tensors, os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**config, "num_nextn_predict_layers": 1}, f)
    model = load_model(ModelConfig(model=d), CPU)
    assert torch.equal(_logits(model), _logits(load_model(ModelConfig(model=checkpoints["glm4_moe"][1]), CPU)))


@pytest.mark.parametrize("shape", [(200, 130), (130, 256)])  # a partial last column block, and whole ones
def test_the_served_dequantisation_is_code_times_block_scale(shape: tuple[int, int]) -> None:
    from fastdeploy_r3.model_executor.quantization.fp8 import dequantize, expand_scale_rows

    codes, scale = quantize_blockwise(torch.randn(shape, generator=torch.Generator().manual_seed(2)))
    want = _dequantised_by_hand(codes, scale)
    rows = expand_scale_rows(scale, shape[0])
    assert torch.equal(dequantize(codes, rows, torch.float32), want)
    assert torch.equal(dequantize(codes, rows, torch.bfloat16), want.bfloat16())  # one rounding, from float32
    stacked = torch.stack([codes, codes])  # [E, O, I] as the experts hold them
    assert torch.equal(dequantize(stacked, torch.stack([rows, rows * 2]), torch.float32)[1], want * 2)
