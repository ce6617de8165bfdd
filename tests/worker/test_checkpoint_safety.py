"""A worker's weight update from a hostile or broken checkpoint directory: each of them is refused
before any weight changes, with a message that names the defect but no server path, no header text
and no traceback; lossless dtype conversions load."""

from __future__ import annotations

import pytest
import torch
from broken_checkpoints import SECRET, broken_checkpoints
from safetensors.torch import load_file, save_file

from fastdeploy_r3.config import ModelConfig
from fastdeploy_r3.model_executor.model_loader import load_model
from fastdeploy_r3.worker.weight_updater import WeightUpdateError, WeightUpdater

EXPECTED = {
    "not_safetensors": "not a readable safetensors file",
    "truncated_data": "not a readable safetensors file",
    "truncated_header": "not a readable safetensors file",
    "bad_header_json": "not a readable safetensors file",
    "secret_in_header": "not a readable safetensors file",
    "bad_index_json": "is not valid JSON",
    "list_index": "no 'weight_map' object",
    "traversal_index": "names a file outside model_path",
    "absolute_index": "names a file outside model_path",
    "dev_zero_symlink": "leads outside model_path",
    "fifo": "is not a regular file",
    "symlink_out": "leads outside model_path",
    "int8": "is stored as I8; only floating point weights",
    "bool": "is stored as BOOL; only floating point weights",
    "nan": "holds NaN or inf values",
    "lossy_float64": "do not fit the model's float32 exactly",
}


@pytest.fixture(scope="module")
def broken(fake_model_dir, tmp_path_factory) -> dict[str, str]:
    return broken_checkpoints(fake_model_dir("qwen3_moe", seed=1), str(tmp_path_factory.mktemp("broken")))


@pytest.fixture(scope="module")
def model(fake_model_dir) -> torch.nn.Module:
    return load_model(ModelConfig(model=fake_model_dir("qwen3_moe")), torch.device("cpu"))


@pytest.mark.parametrize("defect", sorted(EXPECTED))
def test_a_broken_checkpoint_is_refused_whole_and_says_why_without_leaking(defect, broken, model) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightUpdateError) as info:
        WeightUpdater(model, torch.device("cpu"), 0).from_disk(broken[defect])
    message = str(info.value)
    assert EXPECTED[defect] in message and "no weight changed" in message
    assert "/" not in message.replace("model_path", "") and SECRET not in message and "Traceback" not in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bfloat16_weights_load_into_a_float32_model_exactly(fake_model_dir, tmp_path, model) -> None:
    good = fake_model_dir("qwen3_moe", seed=2)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(f"{good}/model.safetensors").items()}
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_bytes(open(f"{good}/{name}", "rb").read())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    WeightUpdater(model, torch.device("cpu"), 0).from_disk(str(tmp_path))
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"].float())


def test_one_broken_tensor_in_a_trainers_bucket_is_named_and_a_huge_finite_one_loads() -> None:
    """A bucket is checked with one fused pass; the exact rule still decides which tensor is broken,
    and a finite weight whose sum of squares overflows is not refused for it."""
    from fastdeploy_r3.model_executor.checkpoint_safety import CheckpointError, check_tensors

    bucket = [(f"model.layers.0.mlp.experts.{e}.up_proj.weight", torch.ones(2, 3, dtype=torch.bfloat16) * e)
              for e in range(8)]
    bucket[5][1][1, 2] = float("nan")
    with pytest.raises(CheckpointError, match=r"experts\.5\.up_proj.*NaN or inf"):
        check_tensors(bucket, torch.bfloat16)
    huge = [("model.norm.weight", torch.full((4,), 3e38, dtype=torch.bfloat16)),
            ("lm_head.weight", torch.ones(2, 2, dtype=torch.float32))]
    checked = check_tensors(huge, torch.bfloat16)
    assert [n for n, _ in checked] == ["model.norm.weight", "lm_head.weight"]
    assert checked[1][1].dtype == torch.bfloat16 and torch.equal(checked[0][1], huge[0][1])
