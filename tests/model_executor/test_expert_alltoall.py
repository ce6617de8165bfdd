"""The all-to-all dispatch's arithmetic in one process: N threads, each one rank of a tiny Qwen3-MoE layer
(16 experts, top-4) with its own experts, exchange rows through an in-memory group. Every (token, k) row
runs exactly once, on the rank of its expert's replica (t mod replicas), as that rank's slot of the same
logical expert; every rank ends with every token's whole routed output, bit-equal to the layer's rows
computed one at a time and summed over k in k order; the bytes counter counts what left each rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from fastdeploy_r3.config import ConfigError, EngineConfig, ModelConfig
from fastdeploy_r3.model_executor import model_loader
from fastdeploy_r3.model_executor.layers.expert_alltoall import (
    AllToAllDispatch,
    ExchangedRows,
    use_moe_a2a_backend,
)
from fastdeploy_r3.model_executor.layers.expert_placement import ExpertPlacement, ExpertPlacementError
from fastdeploy_r3.model_executor.layers.moe import StackedExperts

CPU = torch.device("cpu")


class ThreadHub:
    """What N threads exchange: each posts a value, all wait, each reads every rank's, all wait again."""

    def __init__(self, size: int) -> None:
        self.size, self.box, self.barrier = size, [None] * size, threading.Barrier(size, timeout=30)

    def exchange(self, rank: int, value: object) -> list:
        self.box[rank] = value
        self.barrier.wait()
        every = list(self.box)
        self.barrier.wait()
        return every


class ThreadGroup:
    """A DispatchGroup (layers/expert_alltoall.py) over threads, with torch.distributed's semantics."""

    def __init__(self, hub: ThreadHub, rank: int) -> None:
        self.hub, self.rank, self.size = hub, rank, hub.size

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        every = self.hub.exchange(self.rank, [p.clone() for p in inp.split(in_splits)])
        pieces = [every[j][self.rank] for j in range(self.size)]
        assert [p.shape[0] for p in pieces] == out_splits
        out.copy_(torch.cat(pieces))

    def all_gather(self, out: list[torch.Tensor], inp: torch.Tensor) -> None:
        for o, x in zip(out, self.hub.exchange(self.rank, inp.clone()), strict=True):
            o.copy_(x)


def run_ranks(size: int, fn: Callable[[int, ThreadGroup], object]) -> list:
    """fn(rank, group) on `size` threads at once; their results in rank order (a thread's error re-raised)."""
    hub, results, errors = ThreadHub(size), [None] * size, []

    def main(rank: int) -> None:
        try:
            results[rank] = fn(rank, ThreadGroup(hub, rank))
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)
            hub.barrier.abort()

    threads = [threading.Thread(target=main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def experts_of(model: torch.nn.Module) -> StackedExperts:
    experts = model.model.layers[0].mlp.experts
    experts.batch_invariant = True  # row-invariant GEMMs: a row's bits do not depend on its batch
    return experts


EP4 = [ExpertPlacement.contiguous(16, 4, r) for r in range(4)]
EP2_REDUNDANT = [ExpertPlacement.redundant(tuple((p + 5) % 16 for p in range(16)) + (0, 7, 12, 5), 16, 2, r)
                 for r in range(2)]


# 11 tokens: not a multiple of 2 or 4, the last rank owns fewer and the all-gather pads; 3 tokens on 4 ranks:
# the last rank owns none and still takes part in every collective
@pytest.mark.parametrize(("placements", "num_tokens"), [
    pytest.param(EP4, 11, id="ep4-contiguous"),
    pytest.param(EP4, 3, id="ep4-fewer-tokens-than-ranks"),
    pytest.param(EP2_REDUNDANT, 11, id="ep2-redundant"),
])
def test_rows_go_to_their_experts_rank_and_come_back_summed_in_k_order(fake_model_dir, placements,
                                                                       num_tokens: int) -> None:
    mc = ModelConfig(model=fake_model_dir("qwen3_moe"), dtype="float32")
    whole = model_loader.load_model(mc, CPU)
    full = experts_of(whole)
    size = len(placements)
    ranks = [experts_of(model_loader.load_model(mc, CPU, expert_placement=p)) for p in placements]
    x = torch.randn(num_tokens, whole.hidden_size, generator=torch.Generator().manual_seed(2))  # [T, H]
    weights, ids = whole.model.layers[0].mlp.route(x)  # [T, K] logical
    top_k, hidden = ids.shape[1], x.shape[1]
    # each (token, k) row alone through the whole layer, then summed over k in k order
    with torch.no_grad():
        one = torch.stack([full(x[t : t + 1], weights[t : t + 1, k : k + 1], ids[t : t + 1, k : k + 1])[0]
                           for t in range(num_tokens) for k in range(top_k)])  # [T * K, H]
    want = one.view(num_tokens, top_k, hidden).sum(dim=1)  # [T, H]

    def rank_main(rank: int, group: ThreadGroup) -> tuple[ExchangedRows, torch.Tensor, AllToAllDispatch]:
        layer = ranks[rank]
        layer.dispatch = AllToAllDispatch(placements[rank], group)
        with torch.no_grad():
            rows = layer.dispatch.dispatch(x, weights, ids)
            return rows, layer(x, weights, ids), layer.dispatch

    results = run_ranks(size, rank_main)
    flat_ids = ids.reshape(-1)
    ran = torch.cat([rows.rows for rows, _, _ in results])
    assert sorted(ran.tolist()) == list(range(num_tokens * top_k))  # every row exactly once
    for rank, (rows, out, dispatch) in enumerate(results):
        for row, slot in zip(rows.rows.tolist(), rows.slots[:, 0].tolist(), strict=True):
            token, expert = row // top_k, int(flat_ids[row])
            replicas = placements[rank].replicas(expert)
            assert replicas[token % len(replicas)] == (rank, slot)  # t mod n's replica, as this rank's slot
            assert placements[rank].local_experts[slot] == expert
        assert torch.equal(rows.topk_weights[:, 0], weights.reshape(-1)[rows.rows])
        assert torch.equal(out, want), f"rank {rank}: {(out - want).abs().max()}"
        # what left this rank: its owned rows for other ranks (hidden + 3 float64 meta), the counts, their
        # results back, its padded gather chunk to the others; twice (the test's dispatch and the layer's)
        chunk = -(-num_tokens // size)
        owned = range(rank * chunk, min((rank + 1) * chunk, num_tokens))
        away = sum(1 for t in owned for k in range(top_k)
                   if placements[0].replicas(int(ids[t, k]))[t % len(placements[0].replicas(int(ids[t, k])))][0]
                   != rank)
        came = sum(1 for r in rows.rows.tolist() if r // top_k not in owned)
        b = dispatch.bytes_sent
        assert b.calls == 2 and b.dispatch == 2 * (away * (hidden * 4 + 24) + (size - 1) * 8)
        assert b.combine == came * hidden * 4 and b.gather == (size - 1) * chunk * hidden * 4


def test_the_backend_flag_installs_the_dispatch_on_every_expert_parallel_layer(fake_model_dir) -> None:
    """What worker/model_runner.py does after loading under --moe-a2a-backend: every MoE layer of rank 1 of
    EP=2 gets an AllToAllDispatch over the group; "local" puts LocalDispatch back."""
    mc = ModelConfig(model=fake_model_dir("qwen3_moe"), dtype="float32")
    model = model_loader.load_model(mc, CPU, expert_placement=ExpertPlacement.contiguous(16, 2, 1))
    layers = [m for m in model.modules() if isinstance(m, StackedExperts)]
    group = ThreadGroup(ThreadHub(2), 1)
    use_moe_a2a_backend(model, "alltoall", group)
    assert len(layers) == 4 and all(isinstance(m.dispatch, AllToAllDispatch) and m.dispatch.group is group
                                    and m.dispatch.complete for m in layers)
    use_moe_a2a_backend(model, "local")
    assert all(type(m.dispatch).__name__ == "LocalDispatch" and not m.dispatch.complete for m in layers)
    with pytest.raises(ExpertPlacementError, match=r"group rank 0 of 2: the all-to-all runs over the expert"):
        use_moe_a2a_backend(model, "alltoall", ThreadGroup(ThreadHub(2), 0))


def test_alltoall_needs_expert_parallelism(fake_model_dir) -> None:
    model = fake_model_dir("qwen3_moe")
    with pytest.raises(ConfigError, match=r"alltoall' dispatches tokens between expert-parallel ranks: add "):
        EngineConfig.from_kwargs(model, moe_a2a_backend="alltoall")
    with pytest.raises(ConfigError, match=r"moe_a2a_backend='deepep'; use local or alltoall"):
        EngineConfig.from_kwargs(model, tensor_parallel_size=2, enable_expert_parallel=True, moe_a2a_backend="deepep")
    whole = model_loader.load_model(ModelConfig(model=model), CPU)
    with pytest.raises(ExpertPlacementError, match=r"needs expert parallelism \(--enable-expert-parallel\)"):
        use_moe_a2a_backend(whole, "alltoall")
