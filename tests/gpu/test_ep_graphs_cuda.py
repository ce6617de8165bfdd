"""Expert parallelism under CUDA graphs: the local dispatch's fixed-shape rows (layers/expert_dispatch.py)
are capturable, and EP=2 decode steps replayed from graphs give the tokens and R3 rows of the same engine
run eagerly, and of one rank, also after an EPLB rebalance (which re-captures the graphs: they baked in
the old replica tables); the expert load record counts graph-replayed decode steps and never their padding.

Run (the lead, on the device tool): one GPU for the first and last tests, two (nvidia-h200-x2) for the others:
    PYTHONPATH=$PWD:$PWD/tools:$PWD/tests/gpu python -m pytest -q tests/gpu/test_ep_graphs_cuda.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import two_gpu_runs
from fake_model import make_fake_model

from fastdeploy_r3 import LLM
from fastdeploy_r3.config import ModelConfig
from fastdeploy_r3.model_executor import model_loader
from fastdeploy_r3.model_executor.layers.expert_dispatch import LocalDispatch
from fastdeploy_r3.model_executor.layers.expert_placement import ExpertPlacement

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (nvidia-h200-x2)")
SEED = 17


def test_fixed_shape_dispatch_replays_from_a_graph_as_it_runs_eagerly(tmp_path) -> None:
    """Rank 1 of an EP=2 placement on one GPU: the experts' forward (dispatch, fused experts, combine) captured
    once, replayed on new inputs, equals the eager forward bit for bit; compact rows on the CPU agree."""
    model_dir = make_fake_model("qwen3_moe", str(tmp_path / "m"), preset="tiny", seed=0)
    placement = ExpertPlacement.contiguous(16, 2, 1)
    mc = ModelConfig(model=model_dir, dtype="float32")
    cuda = torch.device("cuda")
    block = model_loader.load_model(mc, cuda, expert_placement=placement).model.layers[0].mlp
    experts = block.experts
    assert isinstance(experts.dispatch, LocalDispatch) and experts.dispatch.fixed_shape is None  # CUDA: fixed
    gen = torch.Generator(device="cuda").manual_seed(5)
    x_static = torch.randn(8, experts.w13.shape[2], device=cuda, generator=gen)
    with torch.no_grad():
        w, ids = block.route(x_static)
        w_static, ids_static = w.clone(), ids.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            experts(x_static, w_static, ids_static)  # warm-up: Triton compiles
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_static = experts(x_static, w_static, ids_static)
        for _ in range(3):
            x = torch.randn(x_static.shape, device=cuda, generator=gen)
            w, ids = block.route(x)
            x_static.copy_(x), w_static.copy_(w), ids_static.copy_(ids)
            graph.replay()
            torch.testing.assert_close(out_static, experts(x, w, ids), rtol=0, atol=0)


@two_gpus
def test_ep2_decode_graphs_equal_eager_and_one_rank(tmp_path) -> None:
    model_dir = make_fake_model("qwen3_moe", str(tmp_path / "m"), preset="tiny", seed=0)
    ep = {"enable_expert_parallel": True}
    graphs = two_gpu_runs.run(model_dir, 2, SEED, **ep)
    eager = two_gpu_runs.run(model_dir, 2, SEED, enforce_eager=True, **ep)
    one = two_gpu_runs.run(model_dir, 1, SEED)
    for got in (graphs, eager):
        assert got[0] == one[0]
        assert all(np.array_equal(a, b) for a, b in zip(got[1], one[1], strict=True))


@two_gpus
def test_ep2_graphs_after_a_rebalance_equal_one_rank(tmp_path) -> None:
    model_dir = make_fake_model("qwen3_moe", str(tmp_path / "m"), preset="tiny", seed=0)
    prompts = two_gpu_runs.prompts(SEED)
    one = two_gpu_runs.run(model_dir, 1, SEED)
    with LLM(model_dir, device="cuda", dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True,
             ep_num_redundant_experts=2, block_size=4, max_num_seqs=4, num_gpu_blocks_override=256,
             routing_replay_config=two_gpu_runs.R3) as llm:  # fmt: skip
        llm.start_expert_distribution_record()
        before = llm.generate(prompts, two_gpu_runs.GREEDY, use_tqdm=False)
        p2l = llm.rebalance_experts()
        llm.engine.control.flush_cache()  # recompute every prefix on the new placement
        after = llm.generate(prompts, two_gpu_runs.GREEDY, use_tqdm=False)
    assert p2l != list(range(16)) + [0, 1]
    for outs in (before, after):
        assert [o.outputs[0].token_ids for o in outs] == one[0]
        assert all(np.array_equal(o.outputs[0].routed_experts, b) for o, b in zip(outs, one[1], strict=True))


def test_expert_load_record_counts_graph_replayed_steps_without_padding(tmp_path) -> None:
    """One GPU, decode from the padded graphs (3 requests replay the graph of 4): the record counts every real
    token's rows, graph-replayed ones included, and no padding row: it equals the bincount of the R3 rows."""
    model_dir = make_fake_model("qwen3_moe", str(tmp_path / "m"), preset="tiny", seed=0)
    prompts = two_gpu_runs.prompts(SEED)[:3]
    with LLM(model_dir, device="cuda", dtype="float32", block_size=4, max_num_seqs=4, enable_prefix_caching=False,
             routing_replay_config=two_gpu_runs.R3) as llm:  # fmt: skip
        llm.start_expert_distribution_record()
        outs = llm.generate(prompts, two_gpu_runs.GREEDY, use_tqdm=False)
        llm.stop_expert_distribution_record()
        llm.generate(prompts[:1], two_gpu_runs.GREEDY, use_tqdm=False)  # after the stop: graphs replay, no count
        counts = np.array(llm.dump_expert_distribution_record())
    rows = np.concatenate([o.outputs[0].routed_experts for o in outs])  # [n, L, K]
    want = np.stack([np.bincount(rows[:, layer].reshape(-1), minlength=16) for layer in range(rows.shape[1])])
    assert np.array_equal(counts, want)
