"""The one place the kernels get Triton from: the import, the interpret rule, `jit`, and when a kernel runs.

Every kernel module under ops/ imports `triton`, `tl` and `jit` from here and asks `use_triton(x)`
before it launches (tests/model_executor/test_triton_setup.py checks that no other module imports
triton). The rule:

    INTERPRET   Triton's own TRITON_INTERPRET knob, read once at import: `jit` then builds interpreted
                kernels (that is how the CPU tests run them), and every kernel of the process serves
                CPU tensors, the MoE alignment and the R3 capture as much as attention.
    use_triton  a kernel serves CUDA tensors always, CPU tensors only when INTERPRET; otherwise the
                caller takes the pure-torch reference beside each kernel.
    pdl         programmatic dependent launch (Hopper and later, compiled kernels only; PDL_ENABLED, or
                FDR3_PDL=0 in the environment, turns it off): see wait_for_inputs below.

CPU-only installs without triton import this module fine: `jit` returns the function undecorated,
`use_triton` is False everywhere, and `require_triton` names the missing extra if a kernel is called.
"""

from __future__ import annotations

import functools
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
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no triton, or one without grid dependency control
    gdc_launch_dependents = gdc_wait = None

__all__ = [
    "INTERPRET", "PDL_ENABLED", "TritonUnavailableError", "jit", "let_dependents_launch", "mma", "pdl",
    "pdl_prologue", "prefetch_rows", "require_triton", "tl", "triton", "use_triton", "wait_for_inputs",
]  # fmt: skip


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
# Programmatic dependent launch (see wait_for_inputs); a module flag so a benchmark can compare both ways
PDL_ENABLED = os.environ.get("FDR3_PDL", "1") != "0"


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


def num_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors (4 off CUDA: the interpreter's launches stay small)."""
    return _sm_count(device.index or 0) if device.type == "cuda" else 4


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _hopper_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl(x: torch.Tensor) -> bool:
    """Whether kernels serving x's device use programmatic dependent launch: compiled (not INTERPRET) on a
    Hopper or later GPU, with a triton that has grid dependency control, and PDL_ENABLED."""
    return (PDL_ENABLED and x.is_cuda and not INTERPRET and gdc_wait is not None
            and _hopper_or_later(x.device.index or 0))  # fmt: skip


# Programmatic dependent launch. A kernel launched with launch_pdl=True may start while the kernel before
# it on the stream is still running: as soon as every program of that one has called
# let_dependents_launch (or exited). Until it calls wait_for_inputs it may only read what no kernel of
# the step writes (weights, and what a kernel two launches back wrote when the one in between waited
# before letting it launch); wait_for_inputs returns once every earlier kernel has finished and its
# writes are visible. So a kernel launched this way waits before its first dependent read and before
# its first write, and a one-row GEMV prefetches its weight rows into L2 (prefetch_rows) while the small
# kernel before it (a norm, the attention) still runs, instead of after it. Kernels that let the next
# one launch before they wait themselves (pdl_prologue) let a chain start several launches ahead; each
# still finishes after the one before it, and a program only waits on a kernel whose programs have all
# started, so the chain cannot deadlock. Both calls do nothing where PDL is False (their constexpr
# argument: pass pdl(x)), and where the kernel was launched without launch_pdl.


@jit
def wait_for_inputs(PDL: tl.constexpr):
    """Block until the kernels launched before this one are done and their writes visible (PDL only)."""
    if PDL:
        gdc_wait()


@jit
def let_dependents_launch(PDL: tl.constexpr):
    """Allow a kernel launched after this one with launch_pdl=True to start now (PDL only)."""
    if PDL:
        gdc_launch_dependents()


@jit
def pdl_prologue(PDL: tl.constexpr):
    """The first line of a small kernel launched with launch_pdl=PDL: the next kernel may launch (it waits
    for this one in turn), and this one waits for the kernel before it before it reads anything."""
    let_dependents_launch(PDL)
    wait_for_inputs(PDL)


@jit
def prefetch_rows(w_ptr, n, n_ok, row_len, stride_wn, ROW_CHUNKS: tl.constexpr, CHUNK: tl.constexpr):
    """Ask L2 for rows n [BN] of a row-major weight (row_len elements a row, CHUNK elements per 32-byte L2
    sector, ROW_CHUNKS >= row_len / CHUNK), one prefetch instruction a sector, nothing returned. Called
    before wait_for_inputs, it lets a kernel launched early stream its weight while the one before runs."""
    c = tl.minimum(tl.arange(0, ROW_CHUNKS) * CHUNK, row_len - 1)  # [RC] element offsets within a row
    rows = tl.where(n_ok, n, 0).to(tl.int64) * stride_wn  # [BN]; a masked row asks for row 0 again
    ptrs = w_ptr + rows[:, None] + c[None, :]  # [BN, RC]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)  # fmt: skip
