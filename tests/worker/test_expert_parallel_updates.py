"""Weight updates under expert parallelism (two ranks, tiny fakes: 16 experts, rank 0 holds 0..7, rank 1
8..15), for the paths that are not a checkpoint directory (tests/worker/test_expert_parallel.py has that
one): tensors handed to LLM.update_weights reach each rank without the other rank's experts, and the engine
then equals a fresh EP engine started on the new weights; a trainer's broadcast over gloo (which every rank
of the group must receive whole, docs/expert_parallel.md) leaves each rank with exactly the weights a fresh
rank loads. The sender's filter and the model's loader agree on every checkpoint name.
"""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.model_executor.layers.expert_placement import routed_expert_of
from fastdeploy_r3.model_executor.model_loader import (
    expert_placements_of_ranks,
    iter_safetensors,
    load_model,
    safetensors_files,
)

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPTS = [[7, 81, 301, 12, 9, 140, 66, 2, 45], [7, 81, 301, 12, 9, 140, 66, 2, 19, 240]]
CPU = torch.device("cpu")


def _ep2(model_dir: str) -> EngineConfig:
    return EngineConfig.from_kwargs(model_dir, tensor_parallel_size=2, enable_expert_parallel=True)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "glm4_moe"])
def test_the_senders_filter_is_the_loaders_rule(fake_model_dir, family: str) -> None:
    """For every checkpoint name, placement.holds_checkpoint_tensor (what the engine sends a rank) is
    holds_checkpoint_weight of that rank's model (what its loader keeps): nothing it needs is left out."""
    config = _ep2(fake_model_dir(family))
    placements = expert_placements_of_ranks(config.parallel_config, config.model_config)
    assert placements is not None and len(placements) == 2
    names = list(load_model(config.model_config, CPU).checkpoint_weight_shapes())
    for rank, placement in enumerate(placements):
        model = load_model(config.model_config, CPU, rank, 2, placement)
        assert [n for n in names if placement.holds_checkpoint_tensor(n)] == \
            [n for n in names if model.holds_checkpoint_weight(n)]
        dropped = {routed_expert_of(n) for n in names if not placement.holds_checkpoint_tensor(n)}
        assert dropped == set(range(8, 16) if rank == 0 else range(8))
    assert routed_expert_of("model.layers.1.mlp.shared_experts.gate_proj.weight") is None


def _run(llm: LLM) -> list[tuple[list[int], list[list[list[int]]]]]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(o.outputs[0].error is None for o in outs)
    return [(o.outputs[0].token_ids, o.outputs[0].routed_experts.tolist()) for o in outs]


def test_an_update_from_tensors_gives_each_rank_its_experts_and_equals_a_fresh_ep_engine(fake_model_dir) -> None:
    old, new = fake_model_dir("qwen3_moe", seed=0), fake_model_dir("qwen3_moe", seed=1)
    tensors = dict(iter_safetensors(safetensors_files(new)))
    per_expert = sum(1 for n in tensors if routed_expert_of(n) == 0)
    shared = len(tensors) - 16 * per_expert  # attention, norms, routers, embeddings: every rank's
    kw = {"tensor_parallel_size": 2, "enable_expert_parallel": True, "block_size": 4, "max_num_seqs": 2,
          "num_gpu_blocks_override": 32, "routing_replay_config": {"enable_routing_replay": True}}
    with LLM(new, **kw) as llm:
        want = _run(llm)
    with LLM(old, **kw) as llm:
        before = _run(llm)
        assert llm.update_weights(tensors) == "1"
        # each rank got (and loaded) the tensors every rank needs and its own 8 experts', not the other 8's
        assert llm.engine.control.last_update_tensors == [shared + 8 * per_expert] * 2
        after = _run(llm)
    assert after == want and before != want


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(new_dir: str, port: int, world: int) -> None:
    from fastdeploy_r3.distributed.weight_update_group import destroy_weight_update_group, init_weight_update_group

    group = init_weight_update_group("127.0.0.1", port, 0, world, "wug", "gloo")
    for _, tensor in iter_safetensors(safetensors_files(new_dir)):
        torch.distributed.broadcast(tensor, src=0, group=group)
    destroy_weight_update_group(group)


def _ep_rank(old_dir: str, new_dir: str, port: int, world: int, rank: int, q) -> None:  # noqa: ANN001 - a Queue
    from fastdeploy_r3.model_executor.model_loader import safetensors_shapes
    from fastdeploy_r3.worker.weight_updater import WeightUpdater

    def model(model_dir: str) -> torch.nn.Module:
        config = _ep2(model_dir)
        placements = expert_placements_of_ranks(config.parallel_config, config.model_config)
        return load_model(config.model_config, CPU, rank, 2, placements[rank])

    mine = model(old_dir)
    updater = WeightUpdater(mine, CPU, rank)
    updater.init_group("127.0.0.1", port, 1, world, "wug", "gloo")
    shapes = safetensors_shapes(safetensors_files(new_dir))
    names = list(shapes)  # the file order, which _trainer broadcasts in
    updater.from_distributed(names, ["float32"] * len(names), [list(shapes[k]) for k in names], "wug")
    updater.close()
    a, b = mine.state_dict(), model(new_dir).state_dict()
    q.put((rank, a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)))


def test_a_broadcast_update_under_ep_equals_a_fresh_ep_rank(fake_model_dir) -> None:
    old, new = fake_model_dir("glm4_moe", seed=0), fake_model_dir("glm4_moe", seed=1)
    port, world = _free_port(), 3  # trainer + 2 EP ranks
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_trainer, args=(new, port, world))]
    procs += [ctx.Process(target=_ep_rank, args=(old, new, port, world, r, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted(q.get(timeout=120) for _ in range(2))
    finally:
        for p in procs:
            p.join(timeout=30)
    assert results == [(0, True), (1, True)]
    assert [p.exitcode for p in procs] == [0, 0, 0]
