"""WeightUpdater, below the engine: a worker's model takes new weights from a checkpoint directory and
from a trainer broadcasting over a gloo group, each TP rank its own shard; a wrong update is refused
before any weight changes."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from fastdeploy_r3.config import ModelConfig
from fastdeploy_r3.model_executor.model_loader import iter_safetensors, load_model, safetensors_files
from fastdeploy_r3.worker.weight_updater import WeightUpdateError, WeightUpdater


def _model(model_dir: str, tp_rank: int = 0, tp_size: int = 1) -> torch.nn.Module:
    return load_model(ModelConfig(model=model_dir).finalize(), torch.device("cpu"), tp_rank, tp_size)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_update_from_disk_equals_loading_the_new_checkpoint(fake_model_dir) -> None:
    old, new = fake_model_dir("qwen3_moe", seed=0), fake_model_dir("qwen3_moe", seed=1)
    model = _model(old)
    assert not _same_weights(model, _model(new))
    n = WeightUpdater(model, torch.device("cpu"), 0).from_disk(new)
    assert n == len(model.checkpoint_weight_shapes())
    assert _same_weights(model, _model(new))


def test_a_checkpoint_of_another_model_is_refused_before_any_weight_changes(fake_model_dir) -> None:
    model = _model(fake_model_dir("qwen3_moe"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightUpdateError, match="no weight changed: unexpected weight .model.layers.0.block_sparse"):
        WeightUpdater(model, torch.device("cpu"), 0).from_disk(fake_model_dir("mixtral"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_tensors_of_the_wrong_shape_are_refused(fake_model_dir) -> None:
    model = _model(fake_model_dir("glm4_moe"))
    with pytest.raises(WeightUpdateError, match=r"'lm_head.weight' has shape \(3, 64\), the model expects \(512, 64\)"):
        WeightUpdater(model, torch.device("cpu"), 0).from_tensors([("lm_head.weight", torch.zeros(3, 64))])


def _trainer(new_dir: str, port: int, world: int) -> None:
    from fastdeploy_r3.distributed.weight_update_group import destroy_weight_update_group, init_weight_update_group

    group = init_weight_update_group("127.0.0.1", port, 0, world, "wug", "gloo")
    for _, tensor in iter_safetensors(safetensors_files(new_dir)):
        torch.distributed.broadcast(tensor, src=0, group=group)
    destroy_weight_update_group(group)


def _engine_rank(old_dir: str, new_dir: str, port: int, world: int, tp_rank: int, tp_size: int, q) -> None:
    from fastdeploy_r3.model_executor.model_loader import safetensors_shapes

    model = _model(old_dir, tp_rank, tp_size)
    updater = WeightUpdater(model, torch.device("cpu"), tp_rank)
    updater.init_group("127.0.0.1", port, 1, world, "wug", "gloo")
    shapes = safetensors_shapes(safetensors_files(new_dir))
    names = list(shapes)  # the file order, which _trainer broadcasts in
    n = updater.from_distributed(names, ["float32"] * len(names), [list(shapes[k]) for k in names], "wug")
    updater.close()
    q.put((tp_rank, n, _same_weights(model, _model(new_dir, tp_rank, tp_size))))


def test_update_from_a_trainer_over_gloo_gives_each_tp_rank_its_shard(fake_model_dir) -> None:
    old, new = fake_model_dir("glm4_moe", seed=0), fake_model_dir("glm4_moe", seed=1)
    port, world = _free_port(), 3  # trainer + 2 TP ranks
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_trainer, args=(new, port, world))]
    procs += [ctx.Process(target=_engine_rank, args=(old, new, port, world, r, 2, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted(q.get(timeout=120) for _ in range(2))
    finally:
        for p in procs:
            p.join(timeout=30)
    n = len(_model(new).checkpoint_weight_shapes())
    assert results == [(0, n, True), (1, n, True)]
    assert [p.exitcode for p in procs] == [0, 0, 0]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "glm4_moe"])
def test_checkpoint_weights_are_what_the_checkpoint_holds(fake_model_dir, arch: str) -> None:
    model_dir = fake_model_dir(arch)
    model = _model(model_dir)
    ours = dict(model.checkpoint_weights())
    on_disk = dict(iter_safetensors(safetensors_files(model_dir)))
    assert ours.keys() == on_disk.keys()
    assert all(torch.equal(ours[k], on_disk[k]) for k in ours)


def test_update_from_a_directory_transformers_wrote(fake_model_dir, tmp_path) -> None:
    """A trainer's step: transformers loads the checkpoint, changes every weight, save_pretrained()s it; the
    worker loads that directory in place and computes what transformers computes."""
    transformers = pytest.importorskip("transformers")
    from fastdeploy_r3.model_executor.forward_context import ForwardContext, set_forward_context

    old = fake_model_dir("qwen3_moe", seed=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(old, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    hf.save_pretrained(str(tmp_path))
    model = _model(old)
    WeightUpdater(model, torch.device("cpu"), 0).from_disk(str(tmp_path))
    ids = torch.tensor([5, 77, 301, 12, 9, 140, 66, 2])
    with torch.no_grad(), set_forward_context(ForwardContext(None, [])):
        ours = model.compute_logits(model(ids, torch.arange(len(ids))))  # [T, V]
        theirs = hf(ids[None]).logits[0].float()  # [T, V]
    assert (ours - theirs).abs().max().item() < 1e-4
