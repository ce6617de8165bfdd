"""The expert -> rank map: the identity every model runs today, and a two-rank map under which the
loader reads only this rank's experts (what expert parallelism will load)."""

from __future__ import annotations

import pytest
import torch

from fastdeploy_r3.config import ModelConfig
from fastdeploy_r3.model_executor import model_loader
from fastdeploy_r3.model_executor.forward_context import ForwardContext, set_forward_context
from fastdeploy_r3.model_executor.layers.expert_placement import ExpertPlacement, ExpertPlacementError
from fastdeploy_r3.model_executor.layers.moe import StackedExperts

CPU = torch.device("cpu")


def test_identity_and_round_robin_placements() -> None:
    """identity(4): rank 0 holds experts 0..3 in slots 0..3. Round robin over two ranks, seen from rank 1:
    experts 1 and 3 in slots 0 and 1, experts 0 and 2 elsewhere."""
    identity = ExpertPlacement.identity(4)
    assert identity.local_experts == (0, 1, 2, 3) and identity.is_identity and identity.ep_size == 1
    assert [identity.local_slot(e) for e in range(4)] == [0, 1, 2, 3]
    rank1 = ExpertPlacement(expert_rank=(0, 1, 0, 1), ep_rank=1)
    assert rank1.local_experts == (1, 3) and rank1.num_local_experts == 2 and not rank1.is_identity
    assert [rank1.local_slot(e) for e in range(4)] == [None, 0, None, 1]
    with pytest.raises(ExpertPlacementError, match="expert 4 is outside"):
        rank1.local_slot(4)
    with pytest.raises(ExpertPlacementError, match="ep_rank 2 is not a rank"):
        ExpertPlacement(expert_rank=(0, 1, 0, 1), ep_rank=2)
    with pytest.raises(ExpertPlacementError, match="rank 1 holds no expert"):
        ExpertPlacement(expert_rank=(0, 2, 0, 2), ep_rank=1)


def test_loader_reads_only_the_experts_the_placement_gives_this_rank(fake_model_dir, monkeypatch) -> None:
    """Tiny Qwen3-MoE (16 experts), odd experts on rank 1: its stacked weights hold experts 1, 3, ..., 15
    in slots 0..7, equal to the whole model's, and not one tensor of an even expert is read from disk."""
    mc = ModelConfig(model=fake_model_dir("qwen3_moe"), dtype="float32")
    whole = model_loader.load_model(mc, CPU)
    assert whole.expert_placement.is_identity

    read: list[str] = []
    real_iter = model_loader.iter_safetensors

    def recording_iter(files, device="cpu", keep=None):  # noqa: ANN001, ANN202 (test spy)
        for name, tensor in real_iter(files, device, keep):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(model_loader, "iter_safetensors", recording_iter)
    odd = ExpertPlacement(expert_rank=tuple(e % 2 for e in range(16)), ep_rank=1)
    half = model_loader.load_model(mc, CPU, expert_placement=odd)

    experts_read = {int(name.split(".experts.")[1].split(".")[0]) for name in read if ".experts." in name}
    assert experts_read == set(range(1, 16, 2))
    assert len(read) == len(whole.checkpoint_weight_shapes()) - 8 * 3 * len(whole.moe_layer_ids)
    for mine, full in zip(half.modules(), whole.modules(), strict=True):
        if isinstance(mine, StackedExperts):
            assert mine.w13.shape[0] == mine.w2.shape[0] == 8
            assert torch.equal(mine.w13, full.w13[1::2]) and torch.equal(mine.w2, full.w2[1::2])

    # no token dispatch yet: the layer refuses rather than read slot e as expert e
    with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=None, kv_caches=[])):
        with pytest.raises(ExpertPlacementError, match="needs a token dispatch"):
            half(torch.tensor([5, 6, 7]), torch.arange(3))
