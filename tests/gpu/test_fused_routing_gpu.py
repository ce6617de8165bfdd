"""The fused routing kernel (ops/fused_routing.py) on CUDA at the real models' router shapes, against the
torch routers of layers/moe.py on the same device, and the engine with the kernel against the engine
without it (FDR3_FUSED_ROUTING=0). CI has no GPU (tests/gpu/conftest.py skips these); on an H200:

    python -m pytest -m gpu tests/gpu/test_fused_routing_gpu.py -v -s

Ids are compared bit for bit. The one allowance: a row whose reference scores hold two neighbours among
the best K + 1 closer than NEAR_TIE (a float32 near-tie: the kernel's exp and sums round differently from
torch's by an ulp or two) may order them differently; such rows are counted and printed. Exact ties
follow the stated rule (lower expert id first) on both sides and are tested on purpose.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from fake_model import make_fake_model
from router_probe import cpu_router_logits

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.model_executor.layers.moe import grouped_sigmoid_topk, softmax_topk
from fastdeploy_r3.model_executor.ops.fused_routing import FUSED_ROUTING_ENV, RouterSpec, fused_routing
from fastdeploy_r3.model_executor.ops.moe_align import align_to_blocks_torch

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
NEAR_TIE = 1e-6  # absolute gap between neighbouring scores (probabilities, or sigmoid + bias)

# (spec, E): Qwen3-30B-A3B, GLM-4.5-Air (one group), Mixtral 8x7B, and a group-limited router
# (DeepSeek-V3 / GLM-4.5 shape with n_group 8) so the group path runs at a real size too
FAMILIES = {
    "qwen3-30b-a3b": (RouterSpec(8, "softmax", renormalize=True), 128),
    "qwen3 without norm_topk_prob": (RouterSpec(8, "softmax", renormalize=False), 128),
    "glm-4.5-air": (RouterSpec(8, "sigmoid", True, n_group=1, topk_group=1, routed_scaling_factor=1.0), 128),
    "mixtral": (RouterSpec(2, "softmax", renormalize=True), 8),
    "grouped 8/4": (RouterSpec(8, "sigmoid", True, n_group=8, topk_group=4, routed_scaling_factor=2.5), 256),
}


def reference(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None):
    if spec.scoring == "softmax":
        return softmax_topk(logits, spec.top_k, spec.renormalize)
    return grouped_sigmoid_topk(logits, spec.top_k, bias, spec.n_group, spec.topk_group, spec.renormalize,
                                spec.routed_scaling_factor)  # fmt: skip


def near_ties(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None) -> torch.Tensor:
    """[T] bool: the reference's choice scores hold a near-tie among the best K + 1, or (group-limited) its
    group scores among the best topk_group + 1."""
    def close(scores: torch.Tensor, k: int) -> torch.Tensor:  # [T, N] -> [T]
        top = scores.topk(min(k + 1, scores.shape[1]), dim=-1).values  # [T, k+1]
        return ((top[:, :-1] - top[:, 1:]) < NEAR_TIE).any(dim=-1)

    if spec.scoring == "softmax":
        return close(torch.softmax(logits, dim=-1, dtype=torch.float32), spec.top_k)
    biased = logits.float().sigmoid() + bias  # [T, E]
    if spec.topk_group == spec.n_group:
        return close(biased, spec.top_k)
    per_group = biased.view(biased.shape[0], spec.n_group, -1)  # [T, G, E/G]
    group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    kept = group_scores.sort(dim=-1, descending=True, stable=True).indices[:, : spec.topk_group]  # [T, topk_group]
    mask = torch.zeros_like(group_scores).scatter_(1, kept, 1.0).repeat_interleave(per_group.shape[2], dim=1)
    return close(group_scores, spec.topk_group) | close(biased.masked_fill(mask == 0, float("-inf")), spec.top_k)


def expert_rows(blocks, num_rows: int) -> torch.Tensor:  # noqa: ANN001
    """(expert, flat row) pairs of an alignment, ordered: atomics may order an expert's rows differently."""
    n = int(blocks.num_padded)
    rows = blocks.sorted_ids[:n].long()
    expert = blocks.block_expert[: n // blocks.block_m].long().repeat_interleave(blocks.block_m)
    real = rows < num_rows
    return (expert[real] * num_rows + rows[real]).sort().values


@pytest.mark.parametrize("num_tokens", [1, 7, 256, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_kernel_equals_the_torch_router(family: str, dtype: torch.dtype, num_tokens: int) -> None:
    """Ids, weights, counts, the alignment and the capture rows (the last token padded: slot -1)."""
    spec, num_experts = FAMILIES[family]
    torch.manual_seed(num_tokens)
    logits = (torch.randn(num_tokens, num_experts, device=CUDA) * 2).to(dtype)  # [T, E]
    bias = (torch.randn(num_experts, device=CUDA) * 0.1) if spec.scoring == "sigmoid" else None
    buffer = torch.full((num_tokens + 3, 2, spec.top_k), -1, dtype=torch.int32, device=CUDA)  # [T+3, L, K]
    slots = torch.arange(num_tokens, device=CUDA)
    slots[-1] = -1 if num_tokens > 1 else 0
    got = fused_routing(logits, spec, bias, buffer, moe_index=1, slot_mapping=slots, block_m=16)
    weights, ids = reference(logits, spec, bias)
    torch.cuda.synchronize()

    differ = (got.topk_ids != ids).any(dim=-1)  # [T]
    ties = near_ties(logits, spec, bias)
    assert not (differ & ~ties).any(), f"rows {torch.nonzero(differ & ~ties).flatten().tolist()} differ, no near-tie"
    same = ~differ
    torch.testing.assert_close(got.topk_weights[same], weights[same], rtol=1e-5, atol=1e-6)
    print(f"\n{family} {dtype} T={num_tokens}: {int(differ.sum())} near-tie rows ordered differently "
          f"of {int(ties.sum())} near-tie rows")  # fmt: skip

    num_rows = got.topk_ids.numel()
    assert torch.equal(got.counts.long(), torch.bincount(got.topk_ids.flatten(), minlength=num_experts))
    assert torch.equal(expert_rows(got.blocks, num_rows),
                       expert_rows(align_to_blocks_torch(got.topk_ids, num_experts, 16), num_rows))  # fmt: skip
    real = slots >= 0
    assert torch.equal(buffer[:num_tokens][real, 1].long(), got.topk_ids[real])
    assert (buffer[:num_tokens][~real] == -1).all() and (buffer[num_tokens:] == -1).all()
    assert (buffer[:, 0] == -1).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", ["qwen3-30b-a3b", "glm-4.5-air", "grouped 8/4", "mixtral"])
def test_ties_follow_the_lower_id_rule_on_cuda(family: str, dtype: torch.dtype) -> None:
    """Integer logits in [-2, 2]: every row is full of exact ties; kernel and reference agree bit for bit,
    and a row of equal logits picks experts 0..K-1."""
    spec, num_experts = FAMILIES[family]
    torch.manual_seed(3)
    logits = torch.randint(-2, 3, (300, num_experts), device=CUDA).to(dtype)  # [T, E]
    logits[0] = 0
    bias = torch.zeros(num_experts, device=CUDA) if spec.scoring == "sigmoid" else None
    got = fused_routing(logits, spec, bias)
    weights, ids = reference(logits, spec, bias)
    assert torch.equal(got.topk_ids, ids)
    assert got.topk_ids[0].tolist() == list(range(spec.top_k))
    torch.testing.assert_close(got.topk_weights, weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_tokens", [16, 48])
def test_kernel_in_a_cuda_graph_replays_what_eager_computes(num_tokens: int) -> None:
    """16 tokens take the one-launch path, 48 the two-launch one: recorded once, replayed on new logits,
    ids / weights / alignment / capture rows equal an eager launch; padded rows stay untouched."""
    spec = RouterSpec(8, "softmax", renormalize=True)
    static = torch.randn(num_tokens, 128, device=CUDA, dtype=torch.bfloat16)
    slots = torch.arange(num_tokens, device=CUDA)
    slots[-3:] = -1  # three padded tokens
    buffer = torch.full((64, 1, 8), -1, dtype=torch.int32, device=CUDA)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_routing(static, spec, None, buffer, 0, slots, block_m=16)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_routing(static, spec, None, buffer, 0, slots, block_m=16)
    for seed in range(3):
        torch.manual_seed(seed)
        static.copy_(torch.randn(num_tokens, 128, device=CUDA))
        buffer.fill_(-1)
        graph.replay()
        want = fused_routing(static.clone(), spec, block_m=16)
        assert torch.equal(out.topk_ids, want.topk_ids) and torch.equal(out.topk_weights, want.topk_weights)
        assert torch.equal(out.counts, want.counts)
        num_rows = want.topk_ids.numel()
        assert torch.equal(expert_rows(out.blocks, num_rows), expert_rows(want.blocks, num_rows))
        assert torch.equal(buffer[: num_tokens - 3, 0].long(), want.topk_ids[:-3])
        assert (buffer[num_tokens - 3 :] == -1).all()


# -- the engine with and without the kernel -------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_fake_model("qwen3_moe", str(tmp_path_factory.mktemp("qwen3-tiny")), preset="tiny", seed=0)


def generate(model_dir: str, prompts: list[list[int]], dtype: str):
    r3 = {"enable_routing_replay": True}
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(model_dir, device="cuda", dtype=dtype, block_size=4, max_num_seqs=4, routing_replay_config=r3,
             num_gpu_blocks_override=256) as llm:  # fmt: skip
        outs = llm.generate(prompts, greedy, use_tqdm=False)
    for o in outs:
        assert o.outputs[0].error is None, o.outputs[0].error
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].routed_experts for o in outs]


def router_near_ties(model_dir: str, token_ids: list[int]) -> np.ndarray:
    """[T, L] bool: the router's best K + 1 probabilities hold a near-tie (CPU float32 forward)."""
    layers = cpu_router_logits(model_dir, token_ids)
    spec = RouterSpec(layers[0][0].top_k, "softmax", layers[0][0].renormalize)
    return np.stack([near_ties(logits, spec, None).numpy() for _, logits in layers], axis=1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_rows_with_the_kernel_equal_the_torch_path(model_dir: str, dtype: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """8 prompts (two share a prefix), 6 greedy tokens, decode in CUDA graphs: the engine whose MoE layers
    route through the kernel (the default) returns the tokens and R3 rows of the engine routing with the
    torch ops and the separate capture kernel (FDR3_FUSED_ROUTING=0, inherited by the worker)."""
    rng = random.Random(11)
    base = [rng.randrange(3, 500) for _ in range(20)]
    prompts = [(base if i % 2 else []) + [rng.randrange(3, 500) for _ in range(5 + 3 * i)] for i in range(8)]
    monkeypatch.setenv(FUSED_ROUTING_ENV, "1")
    fused_tokens, fused_rows = generate(model_dir, prompts, dtype)
    monkeypatch.setenv(FUSED_ROUTING_ENV, "0")
    torch_tokens, torch_rows = generate(model_dir, prompts, dtype)
    assert fused_tokens == torch_tokens
    for i, (f, t) in enumerate(zip(fused_rows, torch_rows, strict=True)):
        assert f.shape == t.shape and f.dtype == t.dtype
        differ = (f != t).any(axis=2)  # [rows, L]
        if differ.any():
            ties = router_near_ties(model_dir, prompts[i] + torch_tokens[i][:-1])
            assert dtype == "float32" and (ties[differ]).all(), f"prompt {i}: rows {np.nonzero(differ)} differ"
