"""Where the attention / norm / rotary kernels get Triton from, and when they run.

A kernel runs for CUDA tensors, and for CPU tensors when TRITON_INTERPRET=1 was set before this module
was imported (Triton builds an interpreted kernel at decoration time: that is how the CPU tests run
them). Otherwise callers take the pure-torch reference beside each kernel; CPU-only installs without
triton import this module fine and always take the references.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

__all__ = ["INTERPRET", "mma", "tl", "triton", "triton_jit", "use_triton"]


def triton_jit(fn: Callable[..., Any]) -> Any:
    """triton.jit, or the undecorated function where triton is missing (it is then never launched)."""
    return fn if triton is None else triton.jit(fn)


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernel (compiled or interpreted) serves a tensor on x's device."""
    return triton is not None and (x.is_cuda or INTERPRET)


@triton_jit
def mma(a, b, UPCAST: tl.constexpr):
    """a @ b accumulated in float32, float32 operands at full (IEEE) precision, never TF32.

    UPCAST=True (pass INTERPRET) multiplies bfloat16 operands as float32: the interpreter's dot multiplies
    bfloat16 tiles as their raw uint16 bits (triton 3.9). Same numbers: bf16 x bf16 products are exact in
    float32, and tensor cores accumulate bf16 products in float32 too.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")
