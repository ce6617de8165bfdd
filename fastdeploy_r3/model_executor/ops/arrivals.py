"""Arrival counters: how a kernel combines what its programs wrote without a second launch.

Several programs of one launch each write a partial result (the KV splits of a decode row, the K expert
slots of a token); each then adds one to the counter of what it contributed to (an atomic add, acquire-
release), and the program that brings it to the expected count reads every partial back and writes the
combination, in a fixed order, so the bits never depend on which program came last. That program also
zeroes the counter again, so every launch starts from zeros and no memset precedes it (a memset is a
launch too: at batch 1 a decode step is a chain of such small launches).

One buffer per device, allocated once and never replaced: a CUDA graph keeps the address it captured.
Every kernel of a stream shares it: kernels of one stream touch counters one at a time (one launched
early by programmatic dependent launch touches them only after wait_for_inputs, ops/triton_setup.py).
A kernel that needs more counters than it holds, or that is first called while a graph is being captured
(its zeroing would only run at replay), gets None and takes its two-launch path instead; the graph
runner's eager warm-up before each capture makes the buffer exist first.
"""

from __future__ import annotations

import torch

from fastdeploy_r3.model_executor.ops.triton_setup import jit, tl

ARRIVAL_COUNTERS = 1 << 20  # int32 each: 4 MiB per device

_buffers: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """The device's counters (all zero between launches) when a launch needs n of them, else None."""
    if n > ARRIVAL_COUNTERS:
        return None
    buf = _buffers.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _buffers[device] = torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)
    return buf


@jit
def ordered_sum(first, stride, COUNT: tl.constexpr, mask):
    """first[0] + first[stride] + ... + first[(COUNT - 1) * stride] in float32, added in that order: the
    partials the other programs of the launch wrote, read by the one that counted in last. Read through L2
    (.cg), never a stale L1 line."""
    total = tl.load(first, mask=mask, other=0.0, cache_modifier=".cg")
    for i in tl.static_range(1, COUNT):
        total = total + tl.load(first + i * stride, mask=mask, other=0.0, cache_modifier=".cg")
    return total
