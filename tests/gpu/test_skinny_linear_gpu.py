"""The few-rows dense linear (ops/skinny_linear.py) on CUDA, at the Qwen3-30B-A3B and GLM-4.5-Air shapes.
CI has no GPU (tests/gpu/conftest.py skips these there); run them through the device tool (an H200):

    python -m pytest -m gpu tests/gpu/test_skinny_linear_gpu.py -v

What they hold: the kernel equals a float64 matmul within bf16 rounding of the output (as cuBLAS does);
a row's bits are the same alone, beside other rows and inside a CUDA graph; linear() takes the kernel for
1..MAX_ROWS CUDA rows of a weight of at most MAX_OUT_FEATURES outputs and cuBLAS otherwise, and
FDR3_SKINNY_LINEAR=0 sends every call to cuBLAS.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from fastdeploy_r3.model_executor.batch_invariant import linear
from fastdeploy_r3.model_executor.ops import skinny_linear as sl

pytestmark = pytest.mark.gpu

SHAPES = [(5120, 2048), (2048, 4096), (128, 2048), (151936, 2048), (14336, 4096), (4096, 12288), (100, 72)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_the_kernel_equals_a_float64_matmul_within_bf16_rounding(n: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    bias = torch.randn(n, device="cuda", generator=g).bfloat16()
    for rows in range(1, sl.MAX_ROWS + 1):
        x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
        for b in (None, bias):
            want = x.double() @ w.double().T + (0 if b is None else b.double())
            got = sl.skinny_linear(x, w, b).double()
            cublas = F.linear(x, w, b).double()
            scale = want.abs().max().item()
            # each output is rounded once to bf16 (8 bits), as cuBLAS's is
            assert (got - want).abs().max().item() <= scale * 2**-7, (rows, b is None)
            assert (got - want).abs().max().item() <= 2 * max((cublas - want).abs().max().item(), scale * 2**-9)


def test_a_row_has_the_same_bits_alone_beside_others_and_in_a_graph() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(5120, 2048, device="cuda", generator=g).bfloat16()
    row = torch.randn(1, 2048, device="cuda", generator=g).bfloat16()
    alone = sl.skinny_linear(row, w)
    static = torch.randn(4, 2048, device="cuda", generator=g).bfloat16()
    static[2] = row[0]
    for rows in range(2, sl.MAX_ROWS + 1):
        batch = torch.randn(rows, 2048, device="cuda", generator=g).bfloat16() * 100
        batch[rows - 1] = row[0]
        assert torch.equal(sl.skinny_linear(batch, w)[rows - 1], alone[0]), rows
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        sl.skinny_linear(static, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = sl.skinny_linear(static, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[2], alone[0])


def test_linear_takes_the_kernel_for_few_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = sl._skinny_kernel.run
    monkeypatch.setattr(sl._skinny_kernel, "run", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    w = torch.randn(256, 512, device="cuda").bfloat16()
    for rows, expect in ((1, 1), (8, 1), (9, 0), (64, 0)):
        calls.clear()
        linear(torch.randn(rows, 512, device="cuda").bfloat16(), w, batch_invariant=False)
        assert len(calls) == expect, rows
    calls.clear()
    linear(torch.randn(1, 512, device="cuda").bfloat16(), torch.randn(4096, 512, device="cuda").bfloat16(),
           batch_invariant=False)  # fmt: skip
    assert not calls  # a wide weight: cuBLAS
    calls.clear()
    linear(torch.randn(4, 512, device="cuda").bfloat16(), w, batch_invariant=True)
    assert not calls  # deterministic mode keeps its fixed-tile matmul
    monkeypatch.setenv("FDR3_SKINNY_LINEAR", "0")
    linear(torch.randn(1, 512, device="cuda").bfloat16(), w, batch_invariant=False)
    assert not calls
