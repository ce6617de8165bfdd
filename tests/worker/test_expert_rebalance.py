"""EPLB from measured load: the greedy placement (replicas to the hottest experts per replica, then the
heaviest shares to the least loaded rank), the weight moves between ranks (each rank's slots afterwards
equal a fresh rank loaded with the new placement, bit for bit), and through an EP=2 engine (gloo worker
processes, float32) with 2 redundant slots: tokens and R3 rows before and after a rebalance equal EP=1,
the weight version and the prefix cache survive it, and the placement holds replicas of the hottest
recorded experts.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.config import ConfigError, ModelConfig
from fastdeploy_r3.config.parallel import trivial_physical_to_logical
from fastdeploy_r3.model_executor.layers.expert_placement import ExpertPlacement
from fastdeploy_r3.model_executor.layers.expert_rebalance import move_experts, rebalanced_placement
from fastdeploy_r3.model_executor.model_loader import iter_safetensors, load_model, safetensors_files

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [300, 301, 302, 303, 304]]
R3 = {"enable_routing_replay": True}


def test_greedy_gives_the_extra_slots_to_the_hottest_expert_and_balances_the_ranks() -> None:
    # expert 2 carries 40: two extra replicas (40/2 = 20 > 10, then 40/3 = 13.3 > 10); its three shares go to
    # rank 0, rank 1 (the one not holding it yet), rank 0; then 10 (expert 0) and 5 (expert 3) to the lighter
    # rank 1, and 1 (expert 1) to the only free slot, on rank 0. Each rank's slots in logical order.
    assert rebalanced_placement([10, 1, 40, 5], num_ranks=2, slots_per_rank=3) == (1, 2, 2, 0, 2, 3)
    # no extra slots: a permutation that pairs heavy with light experts
    assert rebalanced_placement([8, 7, 1, 2], num_ranks=2, slots_per_rank=2) == (0, 2, 1, 3)
    assert trivial_physical_to_logical(4, 2) == (0, 1, 2, 3, 0, 1)


def test_redundant_flag_is_checked() -> None:
    from fastdeploy_r3.config.parallel import validate_expert_parallel_flags

    with pytest.raises(ConfigError, match="multiple of the expert-parallel size 2"):
        validate_expert_parallel_flags("local", 2, 3, None)
    with pytest.raises(ConfigError, match="needs expert parallelism"):
        validate_expert_parallel_flags("local", 1, 2, None)
    with pytest.raises(ConfigError, match="either ep_num_redundant_experts or expert_placement_file"):
        validate_expert_parallel_flags("local", 2, 2, "p.json")


class ThreadBroadcast:
    """torch.distributed.broadcast between threads, one per rank, calling it in the same order."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size)
        self.value: torch.Tensor | None = None

    def rank(self, rank: int):  # noqa: ANN201 - the broadcast(tensor, src) callable of one rank
        def broadcast(t: torch.Tensor, src: int) -> None:
            if rank == src:
                self.value = t
            self.barrier.wait()
            if rank != src:
                t.copy_(self.value)
            self.barrier.wait()

        return broadcast


def test_moved_slots_equal_a_fresh_rank_of_the_new_placement(fake_model_dir) -> None:
    mc = ModelConfig(model=fake_model_dir("qwen3_moe"))
    start = trivial_physical_to_logical(16, 2)  # rank 0: 0..8, rank 1: 9..15, 0, 1
    # every rank's slots change, expert 5 gets three replicas (one on each rank, then a second on rank 1)
    target = (5, 9, 10, 11, 12, 13, 14, 15, 3, 0, 1, 2, 4, 5, 5, 6, 7, 8)
    models = [load_model(mc, CPU, r, 2, ExpertPlacement.redundant(start, 16, 2, r)) for r in range(2)]
    group, received = ThreadBroadcast(2), [0, 0]

    def run(r: int) -> None:
        received[r] = move_experts(models[r], target, group.rank(r))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for r in range(2):
        fresh = load_model(mc, CPU, r, 2, ExpertPlacement.redundant(target, 16, 2, r)).state_dict()
        moved = models[r].state_dict()
        assert moved.keys() == fresh.keys()
        assert [k for k in moved if not torch.equal(moved[k], fresh[k])] == []
        assert models[r].expert_placement.local_experts == target[9 * r: 9 * r + 9]
    state = models[0].state_dict()
    per_expert = sum(v[0].numel() * v.element_size() for k, v in state.items() if k.endswith(("experts.w13",
                                                                                                "experts.w2")))
    # rank 0 newly holds 9..15 (7 experts), rank 1 newly 2, 4, 5, 6, 7, 8 (6; it keeps 0 and 1), summed over the
    # 4 MoE layers (per_expert is already every layer's w13 + w2 slot of one expert)
    assert received == [7 * per_expert, 6 * per_expert]


def _generate(llm: LLM) -> tuple[list[list[int]], list[np.ndarray]]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(o.outputs[0].error is None for o in outs)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].routed_experts for o in outs]


def test_an_engine_rebalance_keeps_ep1s_tokens_and_r3_rows(fake_model_dir) -> None:
    """Both dispatches: the local one, and the all-to-all one (its replica tables rebuilt over the same group)."""
    model, new = fake_model_dir("qwen3_moe"), fake_model_dir("qwen3_moe", seed=1)
    with LLM(model, block_size=4, routing_replay_config=R3) as llm:
        want_tokens, want_rows = _generate(llm)
        llm.update_weights(new)
        want_new = _generate(llm)
    new_tensors = dict(iter_safetensors(safetensors_files(new)))
    for backend in ("local", "alltoall"):
        with LLM(model, tensor_parallel_size=2, enable_expert_parallel=True, ep_num_redundant_experts=2,
                 moe_a2a_backend=backend, block_size=4, routing_replay_config=R3) as llm:
            llm.start_expert_distribution_record()
            before_tokens, before_rows = _generate(llm)
            load = np.array(llm.dump_expert_distribution_record()).sum(axis=0)  # [E] over the 4 MoE layers
            version, hits = llm.engine.control.weight_version, llm.engine.metrics()["prefix_hit_blocks"]
            p2l = llm.rebalance_experts()
            after_tokens, after_rows = _generate(llm)  # the same prompts: their blocks are cached from before
            llm.engine.control.flush_cache()
            fresh_tokens, fresh_rows = _generate(llm)  # every token computed on the new slots
            assert llm.engine.control.weight_version == version
            assert llm.engine.metrics()["prefix_hit_blocks"] > hits
            if backend == "local":  # a tensor update after the move: each rank gets the experts of its new slots
                llm.update_weights(new_tensors)
                got_tokens, got_rows = _generate(llm)
                assert got_tokens == want_new[0] != want_tokens
                assert all(np.array_equal(a, b) for a, b in zip(got_rows, want_new[1], strict=True))
        for tokens, rows in ((before_tokens, before_rows), (after_tokens, after_rows), (fresh_tokens, fresh_rows)):
            assert tokens == want_tokens, backend
            for got, want in zip(rows, want_rows, strict=True):
                assert np.array_equal(got, want), backend
        assert p2l == list(rebalanced_placement(load.tolist(), 2, 9)) != list(trivial_physical_to_logical(16, 2))
        # the two extra slots went to the hottest experts per replica: replicas of the recorded hottest experts
        hottest = int(np.argmax(load))
        assert p2l.count(hottest) >= 2
        assert sorted(set(p2l)) == list(range(16)) and len(p2l) == 18
