"""Weight updates onto an fp8 engine (worker/weight_updater.py through quantization/fp8_loading.py): a trainer
pushing bf16 gets its weights served quantized (exactly the online quantization of what it pushed), an fp8
push with its scales lands as is, and a push that cannot land whole is refused before any weight changes."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from fake_model import make_fake_model
from safetensors.torch import load_file, save_file

from fastdeploy_r3.config import ModelConfig
from fastdeploy_r3.model_executor.model_loader import load_model
from fastdeploy_r3.model_executor.quantization.fp8 import FP8_DTYPE, expand_scale_rows, quantize_blockwise
from fastdeploy_r3.worker.weight_updater import WeightUpdateError, WeightUpdater

CPU = torch.device("cpu")
DOWN = "model.layers.1.mlp.experts.5.down_proj.weight"  # [64, 32]: stacked into experts.w2[5]
UP = "model.layers.1.mlp.experts.5.up_proj.weight"  # [32, 64]: rows 32..63 of experts.w13[5]
K_PROJ = "model.layers.0.self_attn.k_proj.weight"  # [32, 64]: rows 64..95 of qkv_proj (after 64 q rows)
GATE = "model.layers.1.mlp.gate.weight"  # the router: stays float32


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("fp8_update")
    return (make_fake_model("qwen3_moe", str(root / "bf16"), dtype="bfloat16"),
            make_fake_model("qwen3_moe", str(root / "fp8"), dtype="bfloat16", fp8=True))


@pytest.fixture(scope="module")
def engine(dirs) -> tuple[torch.nn.Module, WeightUpdater]:
    model = load_model(ModelConfig(model=dirs[1]), CPU)
    return model, WeightUpdater(model, CPU, 0, torch.float32)


def _served(model: torch.nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, expanded scale) the model serves for checkpoint weight `name` (the three above)."""
    layer = model.model.layers
    if name == DOWN:
        experts = layer[1].mlp.experts
        return experts.w2[5], experts.w2_weight_scale_inv[5]
    if name == UP:
        experts = layer[1].mlp.experts
        return experts.w13[5, 32:], experts.w13_weight_scale_inv[5, 32:]
    qkv = layer[0].self_attn.qkv_proj
    return qkv.shard("k"), qkv.shard("k", "weight_scale_inv")


def _assert_serves(model: torch.nn.Module, name: str, codes: torch.Tensor, scale: torch.Tensor) -> None:
    weight, scale_rows = _served(model, name)
    assert weight.dtype == FP8_DTYPE and torch.equal(weight.view(torch.uint8), codes.view(torch.uint8)), name
    assert torch.equal(scale_rows, expand_scale_rows(scale, codes.shape[0])), name


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.view(torch.uint8) if v.dtype == FP8_DTYPE else v).clone() for k, v in model.state_dict().items()}


def _unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(before[k], v.view(torch.uint8) if v.dtype == FP8_DTYPE else v)
               for k, v in model.state_dict().items())


def test_a_bf16_push_lands_quantized_and_an_fp8_push_with_scales_lands_as_is(engine) -> None:
    model, updater = engine
    g = torch.Generator().manual_seed(7)
    pushed = {name: (torch.randn(shape, generator=g) * 0.1).bfloat16()
              for name, shape in ((DOWN, (64, 32)), (UP, (32, 64)), (K_PROJ, (32, 64)))}
    assert updater.from_tensors(list(pushed.items())) == 3
    for name, w in pushed.items():
        _assert_serves(model, name, *quantize_blockwise(w))
    # an fp8 tensor and its scale (here: half the quantizer's) are taken as they are, never re-quantized
    codes, scale = quantize_blockwise(torch.randn(64, 32, generator=g))
    assert updater.from_tensors([(DOWN + "_scale_inv", scale / 2), (DOWN, codes)]) == 2  # any order
    _assert_serves(model, DOWN, codes, scale / 2)
    # the router still takes float weights as they are
    router = torch.randn(16, 64, generator=g)
    updater.from_tensors([(GATE, router)])
    assert torch.equal(model.model.layers[1].mlp.gate.weight, router)


@pytest.mark.parametrize(("tensors", "error"), [
    ([(DOWN, "codes"), (DOWN + "_scale_inv", torch.ones(2, 1))],
     r"weight '.*down_proj.weight_scale_inv' has shape \(2, 1\), the model expects \(1, 1\)"),
    ([(DOWN, "codes"), (DOWN + "_scale_inv", torch.tensor([[float("nan")]]))],
     r"weight '.*down_proj.weight_scale_inv' holds NaN or inf values"),
    ([(DOWN, "codes")], r"fp8 weight '.*down_proj.weight' came without '.*down_proj.weight_scale_inv' in the same"),
    ([(DOWN + "_scale_inv", torch.ones(1, 1))], r"scale '.*down_proj.weight_scale_inv' came without its "
                                                 r"float8_e4m3fn weight"),
    ([(GATE, "router codes")], r"'model.layers.1.mlp.gate.weight' is an fp8 weight or scale of a layer that stays "
                               r"in the model dtype \(router gates, norms, embeddings and lm_head"),
])
def test_an_fp8_push_that_cannot_land_is_refused_with_the_old_weights_still_serving(engine, tensors, error) -> None:
    model, updater = engine
    codes = quantize_blockwise(torch.ones(64, 32))[0]
    router_codes = quantize_blockwise(torch.ones(16, 64))[0]
    named = [(n, codes if t == "codes" else router_codes if t == "router codes" else t) for n, t in tensors]
    named.insert(0, (UP, torch.zeros(32, 64)))  # a good tensor first: it must not land either
    before = _snapshot(model)
    with pytest.raises(WeightUpdateError, match=r"weight update refused, no weight changed: " + error):
        updater.from_tensors(named)
    assert _unchanged(model, before)


def test_from_disk_a_bf16_checkpoint_lands_quantized_and_a_bad_scale_is_refused(dirs, engine, tmp_path) -> None:
    model, updater = engine
    bf16_dir, fp8_dir = dirs
    updater.from_tensors([(DOWN, torch.zeros(64, 32))])  # something else first
    updater.from_disk(bf16_dir)  # the bf16 weights the fp8 checkpoint was quantized from
    fresh = load_model(ModelConfig(model=fp8_dir), CPU)
    assert _unchanged(model, _snapshot(fresh))
    # a pre-quantized checkpoint whose scale is inf: refused by the first pass, nothing changed
    bad = str(tmp_path / "bad")
    shutil.copytree(fp8_dir, bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    tensors[K_PROJ + "_scale_inv"] = torch.full_like(tensors[K_PROJ + "_scale_inv"], float("inf"))
    tensors[DOWN] = quantize_blockwise(torch.ones(64, 32))[0]
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    before = _snapshot(model)
    with pytest.raises(WeightUpdateError, match=r"refused, no weight changed: weight '.*k_proj.weight_scale_inv' "
                                                r"holds NaN or inf"):
        updater.from_disk(bad)
    assert _unchanged(model, before)
    updater.from_disk(fp8_dir)  # the pre-quantized checkpoint itself loads as is
    assert _unchanged(model, _snapshot(fresh))


def test_an_unquantized_engine_refuses_fp8_tensors(dirs) -> None:
    model = load_model(ModelConfig(model=dirs[0]), CPU)
    codes, scale = quantize_blockwise(torch.ones(64, 32))
    with pytest.raises(WeightUpdateError, match=r"is an fp8 weight or scale, but this engine runs quantization "
                                                r"'none'; start it with --quantization fp8"):
        WeightUpdater(model, CPU, 0).from_tensors([(DOWN, codes), (DOWN + "_scale_inv", scale)])


def _trainer(tensors: list[tuple[str, torch.Tensor]], port: int) -> None:
    from fastdeploy_r3.distributed.weight_update_group import destroy_weight_update_group, init_weight_update_group

    group = init_weight_update_group("127.0.0.1", port, 0, 2, "wug", "gloo")
    for _, tensor in tensors:  # gloo has no float8: fp8 goes as its bytes, as the engine receives it
        torch.distributed.broadcast(tensor.view(torch.uint8) if tensor.dtype == FP8_DTYPE else tensor, src=0,
                                    group=group)
    destroy_weight_update_group(group)


def test_a_trainer_broadcasting_bf16_and_fp8_lands_quantized_and_as_is(dirs) -> None:
    """The distributed path (a trainer over gloo, one engine rank): bf16 is quantized on arrival, an announced
    float8_e4m3fn weight and its scale land byte for byte."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    g = torch.Generator().manual_seed(11)
    pushed = (torch.randn(32, 64, generator=g) * 0.1).bfloat16()
    codes, scale = quantize_blockwise(torch.randn(64, 32, generator=g))
    tensors = [(K_PROJ, pushed), (DOWN, codes), (DOWN + "_scale_inv", scale * 3)]
    trainer = mp.get_context("spawn").Process(target=_trainer, args=(tensors, port))
    trainer.start()
    model = load_model(ModelConfig(model=dirs[1]), CPU)
    updater = WeightUpdater(model, CPU, 0, torch.float32, deadline_s=60)
    try:
        updater.init_group("127.0.0.1", port, 1, 2, "wug", "gloo")
        n = updater.from_distributed([name for name, _ in tensors], ["bfloat16", "float8_e4m3fn", "float32"],
                                     [list(t.shape) for _, t in tensors], "wug")
        updater.close()
    finally:
        trainer.join(timeout=60)
    assert (n, trainer.exitcode) == (3, 0)
    _assert_serves(model, K_PROJ, *quantize_blockwise(pushed))
    _assert_serves(model, DOWN, codes, scale * 3)
