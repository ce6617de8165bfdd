"""The fused MoE backends and the batched sampler on CUDA, against the CPU references.

    python -m pytest -m gpu tests/gpu -v -s
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdeploy_r3.model_executor.forward_context import ForwardContext, set_forward_context
from fastdeploy_r3.model_executor.layers.fused_moe import grouped_mm_experts
from fastdeploy_r3.model_executor.layers.moe import SparseMoeBlock, loop_experts
from fastdeploy_r3.model_executor.ops.fused_moe_triton import triton_experts
from fastdeploy_r3.model_executor.ops.moe_align import align_to_blocks_torch, align_to_blocks_triton
from fastdeploy_r3.worker.routing_capture import RoutingCapture
from fastdeploy_r3.worker.sample.draw import SamplingBatch, sample_batch

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
# relative error bounds against a float64 reference: IEEE float32 dots, bf16 operands
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def random_moe(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype):
    x = torch.randn(num_tokens, hidden, device=CUDA).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=CUDA) * 0.05).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=CUDA) * 0.05).to(dtype)
    ids = torch.rand(num_tokens, num_experts, device=CUDA).topk(top_k, dim=-1).indices  # [T, K] distinct
    weights = torch.rand(num_tokens, top_k, device=CUDA)
    return x, w13, w2, weights, ids


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("num_tokens", [1, 3, 64, 256, 512])
def test_align_kernel_gives_each_expert_the_same_rows_as_torch(num_tokens: int) -> None:
    """Atomics may order an expert's rows differently (also across its blocks); the block experts, the
    padding and each expert's set of rows are the same."""
    torch.manual_seed(num_tokens)
    ids = torch.rand(num_tokens, 128, device=CUDA).topk(8, dim=-1).indices  # [T, 8]
    num_rows = ids.numel()
    a, b = align_to_blocks_triton(ids, 128, 16), align_to_blocks_torch(ids, 128, 16)
    n = int(b.num_padded)
    assert int(a.num_padded) == n and bool((a.sorted_ids[n:] == num_rows).all())
    assert torch.equal(a.block_expert[: n // 16], b.block_expert[: n // 16])

    def expert_rows(blocks) -> torch.Tensor:  # noqa: ANN001
        rows = blocks.sorted_ids[:n].long()  # [n]
        expert = blocks.block_expert[: n // 16].long().repeat_interleave(16)  # [n] expert of each position
        real = rows < num_rows
        return (expert[real] * num_rows + rows[real]).sort().values  # (expert, row) pairs, ordered

    assert torch.equal(expert_rows(a), expert_rows(b))
    assert torch.equal(expert_rows(b) // num_rows, ids.reshape(-1)[expert_rows(b) % num_rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 64, 300])
def test_triton_experts_match_the_loop(dtype: torch.dtype, num_tokens: int) -> None:
    torch.manual_seed(num_tokens)
    for shape in ((num_tokens, 128, 8, 256, 96), (num_tokens, 16, 4, 200, 72)):  # 200, 72: ragged tiles
        x, w13, w2, weights, ids = random_moe(*shape, dtype)
        ref = loop_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
        out = triton_experts(x, w13, w2, weights, ids)
        assert out.dtype == dtype and rel_err(out, ref) < TOL[dtype], (shape, rel_err(out, ref))


@pytest.mark.parametrize("num_tokens", [1, 5, 64, 300])
def test_grouped_mm_experts_match_the_loop_in_bf16(num_tokens: int) -> None:
    torch.manual_seed(num_tokens)
    x, w13, w2, weights, ids = random_moe(num_tokens, 128, 8, 256, 96, torch.bfloat16)
    ref = loop_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
    assert rel_err(grouped_mm_experts(x, w13, w2, weights, ids), ref) < TOL[torch.bfloat16]


GATINGS = {
    "qwen3": dict(router="softmax", renormalize=False),
    "mixtral": dict(router="softmax", renormalize=True),
    "glm": dict(router="sigmoid_grouped", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                shared_intermediate_size=64),
}


class _Sink:
    def __init__(self) -> None:
        self.ids: list[torch.Tensor] = []

    def capture(self, moe_index: int, topk_ids: torch.Tensor) -> None:
        self.ids.append(topk_ids.cpu())


@pytest.mark.parametrize("gating", list(GATINGS))
def test_moe_block_on_cuda_equals_the_cpu_loop_float32(gating: str) -> None:
    """The same block (float32) on CPU (loop) and CUDA (auto -> Triton): same captured ids, outputs 1e-5."""
    torch.manual_seed(5)
    block = SparseMoeBlock(128, 32, 4, 64, moe_index=0, **GATINGS[gating])
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(37, 128)
    outs, sinks = {}, {}
    for dev in ("cpu", "cuda"):
        sinks[dev] = _Sink()
        with set_forward_context(ForwardContext(None, [], sinks[dev])):
            outs[dev] = block.to(dev)(x.to(dev)).cpu()
    assert torch.equal(sinks["cpu"].ids[0], sinks["cuda"].ids[0])
    assert ((outs["cuda"] - outs["cpu"]).norm() / outs["cpu"].norm()).item() < 1e-5


@pytest.mark.parametrize("backend,dtype", [("triton", torch.float32), ("triton", torch.bfloat16),
                                           ("grouped_mm", torch.bfloat16)])
def test_moe_block_and_routing_capture_replay_in_a_cuda_graph(backend: str, dtype: torch.dtype) -> None:
    """Record router + capture + experts for 16 tokens once; replay on new inputs == eager, rows included."""
    torch.manual_seed(6)
    block = SparseMoeBlock(256, 64, 8, 128, moe_index=1).to(CUDA, dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    block.experts.backend = backend
    capture = RoutingCapture(64, num_moe_layers=2, top_k=8, num_experts=64, routing_dtype=np.uint8, device=CUDA)
    static_x = torch.randn(16, 256, device=CUDA, dtype=dtype)
    ctx = ForwardContext(None, [], capture)
    with torch.inference_mode(), set_forward_context(ctx):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            capture.begin_step(16)
            block(static_x)  # warm-up: Triton compiles, cuBLAS allocates
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        capture.begin_step(16)
        with torch.cuda.graph(graph):
            static_out = block(static_x)
        for _ in range(3):
            x = torch.randn(16, 256, device=CUDA, dtype=dtype)
            capture.begin_step(16)
            want = block(x)
            want_rows = capture.buffer[:16, 1].clone()
            capture.buffer.fill_(-1)
            static_x.copy_(x)
            graph.replay()
            assert torch.equal(capture.buffer[:16, 1], want_rows)
            assert torch.equal(static_out, want)


@pytest.mark.parametrize("num_tokens", [1, 8, 256])
def test_the_down_gemm_sums_the_slots_as_the_separate_launch_does(num_tokens: int, monkeypatch) -> None:
    """Qwen3-30B-A3B's expert shapes in bf16: the slots summed by the program that lands a token's last one
    give the bits of the separate sum launch, the same in 50 runs whichever program lands last, and every
    arrival counter is zero afterwards."""
    from fastdeploy_r3.model_executor.ops import arrivals, fused_moe_triton

    x, w13, w2, weights, ids = random_moe(num_tokens, 128, 8, 2048, 768, torch.bfloat16)
    fused = triton_experts(x, w13, w2, weights, ids)
    for _ in range(50):
        assert torch.equal(triton_experts(x, w13, w2, weights, ids), fused)
    assert int(arrivals._buffers[x.device].abs().sum()) == 0
    monkeypatch.setattr(fused_moe_triton, "arrival_counters", lambda device, n: None)
    assert torch.equal(triton_experts(x, w13, w2, weights, ids), fused)


def test_batched_sampler_on_cuda_draws_what_the_cpu_draws() -> None:
    """64 rows, mixed greedy / temperature / top-k / top-p, seeded: the noise is integer arithmetic, so
    CUDA and CPU pick the same tokens (logits with clear gaps: no float near-ties)."""
    torch.manual_seed(8)
    logits = torch.randn(64, 1000) * 3
    n = logits.shape[0]
    temperature = [0.0 if i % 4 == 0 else 0.8 for i in range(n)]
    top_k = [20 if i % 3 == 0 else 0 for i in range(n)]
    top_p = [0.9 if i % 5 == 0 else 1.0 for i in range(n)]
    seeds, counters = list(range(100, 100 + n)), [7 * i for i in range(n)]
    cpu = sample_batch(logits, SamplingBatch.build(temperature, top_k, top_p, seeds, counters, torch.device("cpu")))
    cuda = sample_batch(logits.to(CUDA), SamplingBatch.build(temperature, top_k, top_p, seeds, counters, CUDA))
    assert (cuda.cpu() == cpu).float().mean().item() >= 62 / 64
    assert torch.equal(cuda.cpu()[::4], logits.argmax(-1)[::4])
