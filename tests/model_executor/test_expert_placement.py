"""The expert -> rank map: the identity, and two-rank maps under which the loader reads only this rank's
experts and the layer runs only their rows; the expert-parallel flags and their refusals."""

from __future__ import annotations

import pytest
import torch

from fastdeploy_r3.config import ConfigError, EngineConfig, ModelConfig, ParallelConfig
from fastdeploy_r3.model_executor import model_loader
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

    # the layer runs only the rows of its own experts (layers/expert_dispatch.py): its MoE output plus the even
    # experts' rank's is the whole layer's (the all-reduce a real group does); the R3 capture is unchanged
    even = model_loader.load_model(mc, CPU, expert_placement=ExpertPlacement(tuple(e % 2 for e in range(16)), 0))
    x = torch.randn(7, whole.hidden_size, generator=torch.Generator().manual_seed(0))  # [T, H]
    moe = [m.model.layers[1].mlp for m in (whole, half, even)]
    weights, ids = moe[0].route(x)  # [T, K] logical ids
    chosen = set(ids.flatten().tolist())
    assert chosen & set(range(0, 16, 2)) and chosen & set(range(1, 16, 2)), "rows must reach both ranks' experts"
    with torch.no_grad():
        parts = [m.experts(x, weights, ids) for m in moe[1:]]  # [T, H] each rank's partial sum
        torch.testing.assert_close(parts[0] + parts[1], moe[0].experts(x, weights, ids), rtol=1e-6, atol=1e-6)


def test_contiguous_placement_and_expert_parallel_flags(fake_model_dir) -> None:
    """contiguous(16, 2, r): rank 0 experts 0..7, rank 1 experts 8..15; the flags ask for EP = TP, refuse
    any other size, and an expert count the EP size does not divide."""
    rank1 = ExpertPlacement.contiguous(16, 2, 1)
    assert rank1.local_experts == tuple(range(8, 16)) and rank1.ep_size == 2
    with pytest.raises(ExpertPlacementError, match="16 experts do not split evenly over 3"):
        ExpertPlacement.contiguous(16, 3, 0)
    model = fake_model_dir("qwen3_moe")
    assert EngineConfig.from_kwargs(model, tensor_parallel_size=2, enable_expert_parallel=True) \
        .parallel_config.expert_parallel_size == 2
    assert EngineConfig.from_kwargs(model, tensor_parallel_size=2, ep_size=2).parallel_config.expert_parallel_size == 2
    assert EngineConfig.from_kwargs(model, tensor_parallel_size=2).parallel_config.expert_parallel_size == 1
    with pytest.raises(ConfigError, match=r"ep_size=4 differs from tensor_parallel_size=2; .* use --ep-size 2"):
        EngineConfig.from_kwargs(model, tensor_parallel_size=2, ep_size=4)
    hf = {**ModelConfig(model=model).hf_config, "num_experts": 15}
    with pytest.raises(ConfigError, match=r"size 2 does not divide the 15 routed experts.*: 1, 3, 5, 15$"):
        ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).validate_for_model(hf)
    ParallelConfig(tensor_parallel_size=2).validate_for_model(hf)  # TP alone splits no expert count


# EPLB over 2 ranks, 20 physical slots for 16 experts, no physical slot p holding logical expert p:
# rank 0 slots 0..9 = experts 5..14; rank 1 slots 0..9 = experts 15, 0, 1, 2, 3, 4, 0, 7, 12, 5
REDUNDANT = tuple((p + 5) % 16 for p in range(16)) + (0, 7, 12, 5)


def test_redundant_placement_spreads_tokens_over_replicas_and_sums_to_the_whole_layer(fake_model_dir) -> None:
    """Each replica holds its logical expert's weights; token t's row for an expert with n replicas runs on
    replica t mod n (expert 0: rank 1 slots 1 and 6; expert 5: rank 0 slot 0 and rank 1 slot 9), and the two
    ranks' outputs add up to the whole layer's."""
    assert all(e != p for p, e in enumerate(REDUNDANT))
    ranks = [ExpertPlacement.redundant(REDUNDANT, 16, 2, r) for r in range(2)]
    assert ranks[1].local_experts == (15, 0, 1, 2, 3, 4, 0, 7, 12, 5) and ranks[1].local_slots(0) == (1, 6)
    assert ranks[0].replicas(5) == ((0, 0), (1, 9)) and ranks[0].local_slots(0) == () and not ranks[1].is_identity
    with pytest.raises(ExpertPlacementError, match="holds no replica of expert 4;"):
        ExpertPlacement.redundant(REDUNDANT[:15] + (0,), 16, 2, 0)

    mc = ModelConfig(model=fake_model_dir("qwen3_moe"), dtype="float32")
    whole = model_loader.load_model(mc, CPU)
    halves = [model_loader.load_model(mc, CPU, expert_placement=p) for p in ranks]
    full, lo, hi = (m.model.layers[0].mlp.experts for m in (whole, *halves))
    assert torch.equal(hi.w13[1], full.w13[0]) and torch.equal(hi.w13[6], full.w13[0])  # both replicas of 0
    assert torch.equal(lo.w2[0], full.w2[5]) and torch.equal(hi.w2[9], full.w2[5])

    x = torch.randn(64, whole.hidden_size, generator=torch.Generator().manual_seed(1))  # [T, H]
    weights, ids = whole.model.layers[0].mlp.route(x)  # [T, K] logical
    rows = [h.dispatch.dispatch(x, weights, ids) for h in (lo, hi)]
    tokens_of_0 = torch.where(ids == 0)[0]
    assert len({int(t) % 2 for t in tokens_of_0}) == 2, "expert 0 must be chosen by even and odd tokens"
    hi_rows_of_0 = hi.dispatch.dispatch(x, weights, ids)
    slots_of_0 = {int(s) for s, r in zip(hi_rows_of_0.slots[:, 0], hi_rows_of_0.rows, strict=True)
                  if int(ids.reshape(-1)[r]) == 0}
    assert slots_of_0 == {1, 6}
    assert rows[0].rows.numel() + rows[1].rows.numel() == ids.numel()  # each row runs exactly once
    with torch.no_grad():
        torch.testing.assert_close(lo(x, weights, ids) + hi(x, weights, ids), full(x, weights, ids),
                                   rtol=1e-6, atol=1e-6)
