"""The local dispatch's two row shapes give the same bits: compact (this rank's rows cut by a nonzero, a host
sync: the CPU's) and fixed-shape (every (token, k) row kept, other ranks' rows weight 0 at slot 0 and zeroed
in the combine: what CUDA runs, so that decode graphs capture it), on both ranks of a redundant placement.
The experts run their fixed-tile GEMMs (batch_invariant): otherwise slot 0's extra rows may switch the BLAS
to another kernel for that expert (an AVX-512 machine does), which is not the dispatch's doing."""

from __future__ import annotations

import torch

from fastdeploy_r3.config import ModelConfig
from fastdeploy_r3.model_executor import model_loader
from fastdeploy_r3.model_executor.layers.expert_dispatch import LocalDispatch
from fastdeploy_r3.model_executor.layers.expert_placement import ExpertPlacement

CPU = torch.device("cpu")
# 20 slots, 10 a rank: experts 0 and 5 twice, no slot holding the expert of its own number
PLACEMENT = (5, 6, 8, 9, 10, 11, 13, 14, 0, 1, 15, 0, 2, 3, 4, 7, 12, 5, 1, 6)


def test_fixed_shape_rows_equal_compact_rows_bit_for_bit(fake_model_dir) -> None:
    mc = ModelConfig(model=fake_model_dir("qwen3_moe"), dtype="float32")
    whole = model_loader.load_model(mc, CPU)
    block = whole.model.layers[0].mlp
    x = torch.randn(37, whole.hidden_size, generator=torch.Generator().manual_seed(3))  # [T, H]
    weights, ids = block.route(x)  # [T, K] logical
    x_one = x[:1]  # one token: on one rank some of its rows, maybe none
    for rank in range(2):
        placement = ExpertPlacement.redundant(PLACEMENT, 16, 2, rank)
        experts = model_loader.load_model(mc, CPU, expert_placement=placement).model.layers[0].mlp.experts
        experts.batch_invariant = True  # fixed-tile GEMMs: rows added for other ranks cannot change the BLAS kernel
        compact, fixed = LocalDispatch(placement, fixed_shape=False), LocalDispatch(placement, fixed_shape=True)
        a, b = compact.dispatch(x, weights, ids), fixed.dispatch(x, weights, ids)
        assert b.x.shape[0] == ids.numel() and b.keep is not None and a.keep is None
        assert torch.equal(b.rows[b.keep], a.rows)  # the kept rows are exactly the compact ones
        assert torch.equal(b.slots[b.keep], a.slots) and torch.equal(b.topk_weights[b.keep], a.topk_weights)
        assert bool((b.topk_weights[~b.keep] == 0).all()) and bool((b.slots[~b.keep] == 0).all())
        with torch.no_grad():
            for inputs in ((x, weights, ids), (x_one, weights[:1], ids[:1])):
                experts.dispatch = compact
                want = experts(*inputs)
                experts.dispatch = fixed
                got = experts(*inputs)
                assert torch.equal(got, want), f"rank {rank}: fixed-shape rows changed the bits"
