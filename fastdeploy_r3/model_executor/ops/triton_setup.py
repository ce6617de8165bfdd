"""The one place the kernels get Triton from: the import, the interpret rule, `jit`, and when a kernel runs.

Every kernel module under ops/ imports `triton`, `tl` and `jit` from here and asks `use_triton(x)`
before it launches (tests/model_executor/test_triton_setup.py checks that no other module imports
triton). The rule:

    INTERPRET   Triton's own TRITON_INTERPRET knob, read once at import: `jit` then builds interpreted
                kernels (that is how the CPU tests run them), and every kernel of the process serves
                CPU tensors, the MoE alignment and the R3 capture as much as attention.
    use_triton  a kernel serves CUDA tensors always, CPU tensors only when INTERPRET; otherwise the
                caller takes the pure-torch reference beside each kernel.

CPU-only installs without triton import this module fine: `jit` returns the function undecorated,
`use_triton` is False everywhere, and `require_triton` names the missing extra if a kernel is called.
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

__all__ = ["INTERPRET", "TritonUnavailableError", "jit", "mma", "require_triton", "tl", "triton", "use_triton"]


def _interpret_knob() -> bool:
    """What triton.jit itself reads when it decides to build an interpreted kernel."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"  # the rule of older triton's jit


# Read once: triton decides between a compiled and an interpreted kernel when the kernel is decorated.
INTERPRET = _interpret_knob()


class TritonUnavailableError(RuntimeError):
    """A Triton kernel was called where triton is not installed."""


def require_triton(op: str) -> None:
    """Raise TritonUnavailableError naming `op` unless triton is importable."""
    if triton is None:
        raise TritonUnavailableError(f"{op} needs triton; install fastdeploy_r3[triton] (or call the torch reference)")


def jit(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """triton.jit (interpreted under INTERPRET), or the undecorated function where triton is missing.
    `@jit` or `@jit(do_not_specialize=[...])` (triton.jit's options)."""
    if fn is None:
        return lambda f: jit(f, **options)
    return fn if triton is None else triton.jit(fn, **options)


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernel (compiled or interpreted) serves a tensor on x's device."""
    return triton is not None and (x.is_cuda or INTERPRET)


@jit
def mma(a, b, UPCAST: tl.constexpr):
    """a @ b accumulated in float32, float32 operands at full (IEEE) precision, never TF32.

    UPCAST=True (pass INTERPRET) multiplies bfloat16 operands as float32: the interpreter's dot multiplies
    bfloat16 tiles as their raw uint16 bits (triton 3.9). Same numbers: bf16 x bf16 products are exact in
    float32, and tensor cores accumulate bf16 products in float32 too.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")
