"""Weight updates on CUDA: a trainer on GPU 1 broadcasts new weights over NCCL to an engine rank on
GPU 0 (the path /update_weights_from_distributed takes with backend "nccl"), and the offline LLM
updated from disk answers like a fresh LLM on the new weights.

CI has no GPU: tests/gpu/conftest.py skips these there. They need two GPUs for the NCCL case:

    python -m pytest -m gpu tests/gpu/test_weight_update_nccl.py -v -s
"""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

pytestmark = pytest.mark.gpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(new_dir: str, port: int) -> None:
    from fastdeploy_r3.distributed.weight_update_group import destroy_weight_update_group, init_weight_update_group
    from fastdeploy_r3.model_executor.model_loader import iter_safetensors, safetensors_files

    torch.cuda.set_device(1)
    group = init_weight_update_group("127.0.0.1", port, 0, 2, "wug", "nccl")
    for _, tensor in iter_safetensors(safetensors_files(new_dir)):
        torch.distributed.broadcast(tensor.to("cuda:1"), src=0, group=group)
    torch.cuda.synchronize()
    destroy_weight_update_group(group)


def _engine_rank(old_dir: str, new_dir: str, port: int, q) -> None:
    from fastdeploy_r3.config import ModelConfig
    from fastdeploy_r3.model_executor.model_loader import load_model, safetensors_files, safetensors_shapes
    from fastdeploy_r3.worker.weight_updater import WeightUpdater

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    model = load_model(ModelConfig(model=old_dir).finalize(), dev)
    updater = WeightUpdater(model, dev, 0)
    updater.init_group("127.0.0.1", port, 1, 2, "wug", "nccl")
    shapes = safetensors_shapes(safetensors_files(new_dir))
    names = list(shapes)
    n = updater.from_distributed(names, ["float32"] * len(names), [list(shapes[k]) for k in names], "wug")
    torch.cuda.synchronize()
    updater.close()
    want = load_model(ModelConfig(model=new_dir).finalize(), dev).state_dict()
    got = model.state_dict()
    q.put((n, all(torch.equal(got[k], want[k]) for k in want)))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between a trainer and an engine needs two GPUs")
def test_nccl_broadcast_from_a_trainer_updates_the_engine_rank(fake_model_dir) -> None:
    old, new = fake_model_dir("qwen3_moe", seed=0), fake_model_dir("qwen3_moe", seed=1)
    port = _free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_trainer, args=(new, port)), ctx.Process(target=_engine_rank, args=(old, new, port, q))]
    for p in procs:
        p.start()
    try:
        n, same = q.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
    print(f"NCCL update: {n} tensors received, weights equal to the new checkpoint: {same}")
    assert n > 0 and same
    assert [p.exitcode for p in procs] == [0, 0]


def test_llm_update_weights_from_disk_on_cuda_equals_a_fresh_llm(fake_model_dir) -> None:
    from fastdeploy_r3.engine.llm import LLM
    from fastdeploy_r3.sampling_params import SamplingParams

    old, new = fake_model_dir("qwen3_moe", seed=0), fake_model_dir("qwen3_moe", seed=1)
    prompt = list(range(40, 90))
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    r3 = {"enable_routing_replay": True}
    with LLM(new, device="cuda", routing_replay_config=r3) as fresh:
        (want,) = fresh.generate([prompt], greedy, use_tqdm=False)
    with LLM(old, device="cuda", routing_replay_config=r3) as llm:
        llm.generate([prompt], greedy, use_tqdm=False)  # cache the prompt under version "0"
        assert llm.update_weights(new, weight_version="1") == "1"
        (got,) = llm.generate([prompt], greedy, use_tqdm=False)
        hits = llm.engine.metrics()["prefix_hit_blocks"]
    print(f"after the update: tokens {got.outputs[0].token_ids}, cached tokens {got.num_cached_tokens}, hits {hits}")
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert (got.outputs[0].routed_experts == want.outputs[0].routed_experts).all()
    assert got.num_cached_tokens == 0
