"""The few-rows dense linear (ops/skinny_linear.py) against a float64 matmul, run by the real Triton
interpreter on tiny shapes: every row count up to MAX_ROWS, K and N that are not multiples of the tiles,
with and without bias, float32 and bfloat16; and a row's bits do not depend on the rows beside it.
"""

from __future__ import annotations

from triton_interpreted import run_interpreted

PRELUDE = """
import torch
from triton.runtime.interpreter import InterpretedFunction
from fastdeploy_r3.model_executor.ops import skinny_linear as sl
assert isinstance(sl._skinny_kernel, InterpretedFunction)  # really the kernel, not a reference
"""


def test_every_row_count_equals_a_float64_matmul() -> None:
    run_interpreted(
        """
        g = torch.Generator().manual_seed(0)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            for n, k in ((40, 72), (130, 24)):  # N off the 4/8/16 tiles, K off the power-of-two steps
                w = torch.randn(n, k, generator=g).to(dtype)
                b = torch.randn(n, generator=g).to(dtype)
                for rows in range(1, sl.MAX_ROWS + 1):
                    x = torch.randn(rows, k, generator=g).to(dtype)
                    for bias in (None, b):
                        got = sl.skinny_linear(x, w, bias)
                        want = x.double() @ w.double().T + (0 if bias is None else bias.double())
                        assert got.dtype == dtype and got.shape == (rows, n)
                        err = (got.double() - want).abs().max().item() / want.abs().max().item()
                        assert err < tol, (dtype, n, k, rows, err)
        """,
        PRELUDE,
    )


def test_a_row_gets_the_same_bits_alone_and_beside_others() -> None:
    run_interpreted(
        """
        g = torch.Generator().manual_seed(1)
        w = torch.randn(48, 100, generator=g).to(torch.bfloat16)
        row = torch.randn(1, 100, generator=g).to(torch.bfloat16)
        alone = sl.skinny_linear(row, w)
        for rows in (2, 3, 7, 8):
            others = torch.randn(rows - 1, 100, generator=g).to(torch.bfloat16) * 1e3
            batch = torch.cat([others[: rows // 2], row, others[rows // 2 :]])
            assert torch.equal(sl.skinny_linear(batch, w)[rows // 2], alone[0]), rows
        """,
        PRELUDE,
    )


def test_tiles_depend_on_the_weight_shape_only() -> None:
    run_interpreted(
        """
        # Qwen3-30B-A3B's qkv, o, router and lm_head: enough programs for every SM, K per step bounded
        assert sl.tiles(5120, 2048) == (8, 1024)
        assert sl.tiles(2048, 4096) == (4, 2048)
        assert sl.tiles(128, 2048) == (4, 2048)
        assert sl.tiles(151936, 2048) == (16, 512)
        assert sl.tiles(10, 3) == (4, 16)
        """,
        PRELUDE,
    )

