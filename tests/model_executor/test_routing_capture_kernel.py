"""The two R3 Triton kernels against their references, run by the real Triton interpreter.

TRITON_INTERPRET must be set before triton builds the kernels, so each test runs its body in a fresh
interpreter process (the parent may already have imported triton for other tests).
"""

from __future__ import annotations

import pytest
from triton_interpreted import run_interpreted

pytest.importorskip("triton")


PRELUDE = """
import numpy as np
import torch
from fastdeploy_r3.model_executor.ops import routing_capture_kernel as rck
from triton.runtime.interpreter import InterpretedFunction
# really the interpreter, not the torch reference behind the dispatcher
assert rck.use_triton(torch.zeros(1)) and isinstance(rck._capture_topk_ids_kernel, InterpretedFunction)
assert isinstance(rck._scatter_rows_to_host_kernel, InterpretedFunction)
torch.manual_seed(0)
"""


def _run_interpreted(body: str) -> None:
    run_interpreted(body, PRELUDE, timeout=120)


def test_capture_matches_reference_for_every_dtype_and_leaves_other_rows_alone() -> None:
    """Random [T, K] ids into each routing dtype, contiguous and strided; other rows stay as they were."""
    _run_interpreted("""
        calls = []
        orig = rck._capture_topk_ids_kernel.run
        rck._capture_topk_ids_kernel.run = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]
        for dtype in (torch.uint8, torch.uint16, torch.int32):
            for T, L, K in ((1, 1, 1), (5, 3, 2), (70, 4, 8)):
                for moe_index in range(L):
                    base = torch.full((80, L, K), 7, dtype=dtype)
                    ids = torch.randint(0, 200, (T, K + 1), dtype=torch.int64)[:, :K]  # strided view
                    got, want = base.clone(), base.clone()
                    rck.capture_topk_ids_dispatch(got, moe_index, ids)
                    rck.capture_topk_ids_ref(want, moe_index, ids)
                    assert torch.equal(got.to(torch.int64), want.to(torch.int64)), (dtype, T, L, K)
                    assert torch.equal(got[:T, moe_index].to(torch.int64), ids)
        assert len(calls) == 3 * (1 + 3 + 4)
    """)


def test_capture_with_device_side_count_leaves_padded_rows_untouched() -> None:
    """A CUDA graph launches for 6 padded tokens; only the first 4 (count on the device) are real."""
    _run_interpreted("""
        buf = torch.full((8, 2, 3), -1, dtype=torch.int32)
        ids = torch.arange(18, dtype=torch.int32).reshape(6, 3)
        count = torch.tensor([4], dtype=torch.int32)
        rck.capture_topk_ids(buf, 1, ids, num_tokens=count)
        want = torch.full((8, 2, 3), -1, dtype=torch.int32)
        rck.capture_topk_ids_ref(want, 1, ids, num_tokens=count)
        assert torch.equal(buf, want)
        assert torch.equal(buf[:4, 1], ids[:4]) and (buf[4:] == -1).all() and (buf[:, 0] == -1).all()
    """)


def test_scatter_matches_routing_buffer_write_into_shm() -> None:
    """Rows of a step scatter into a SHM RoutingBuffer at their slots (padded slot -1 skipped), as write() does."""
    _run_interpreted("""
        from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer, RoutingBufferSpec
        from fastdeploy_r3.cache_manager.shm import new_engine_suffix
        L, K, S = 3, 2, 16
        for np_dtype in (np.uint8, np.uint16, np.int32):
            name = f"fdr3_{new_engine_suffix()}_test_scatter"
            spec = RoutingBufferSpec(name=name, num_slots=S, num_layers=L, top_k=K, dtype=np.dtype(np_dtype).name)
            got, want = RoutingBuffer.create(spec), RoutingBuffer.create(
                RoutingBufferSpec(name=name + "_ref", num_slots=S, num_layers=L, top_k=K, dtype=spec.dtype))
            try:
                step = torch.randint(0, 250, (6, L, K), dtype=torch.int32)  # [T, L, K] int32 step buffer
                slots = torch.tensor([9, 2, 3, -1, 15, 4])
                tags = torch.tensor([11, 11, 11, 0, 12, 13])
                # torch.from_numpy shares the SHM pages: the kernel writes the segment itself
                rck.scatter_rows_to_host(step, slots, tags, torch.from_numpy(got.rows), torch.from_numpy(got.tags))
                real = slots.numpy() >= 0
                want.write(step.numpy()[real].astype(np_dtype), slots.numpy()[real], tags.numpy()[real])
                assert np.array_equal(got.rows, want.rows) and np.array_equal(got.tags, want.tags)
                assert got.tags[0] == 0 and (got.rows[0] == got.sentinel).all()  # never-touched slot
            finally:
                got.close()
                want.close()
    """)


def test_scatter_with_device_side_count_skips_padded_tokens() -> None:
    """Only the first num_tokens rows of a padded step reach the host buffer."""
    _run_interpreted("""
        host_rows = torch.full((8, 1, 2), 255, dtype=torch.uint8)
        host_tags = torch.zeros(8, dtype=torch.int64)
        step = torch.arange(8, dtype=torch.int32).reshape(4, 1, 2)
        rck.scatter_rows_to_host(step, torch.tensor([5, 6, 7, 0]), torch.tensor([3, 3, 3, 3]), host_rows, host_tags,
                                 num_tokens=torch.tensor([2]))
        assert host_tags.tolist() == [0, 0, 0, 0, 0, 3, 3, 0]
        assert host_rows[5].tolist() == [[0, 1]] and host_rows[6].tolist() == [[2, 3]]
        assert (host_rows[7] == 255).all() and (host_rows[0] == 255).all()
    """)


def test_dispatch_without_interpreter_uses_reference_on_cpu() -> None:
    """The CPU serving path: no interpreter, no Triton launch, same result."""
    import torch

    from fastdeploy_r3.model_executor.ops import routing_capture_kernel as rck

    if rck.use_triton(torch.zeros(1)):
        pytest.skip("this process runs under the Triton interpreter")
    buf = torch.zeros(4, 2, 2, dtype=torch.int32)
    ids = torch.tensor([[1, 2], [3, 4]])
    rck.capture_topk_ids_dispatch(buf, 1, ids)
    assert buf[:2, 1].tolist() == [[1, 2], [3, 4]] and int(buf[2:].abs().sum()) == 0 and int(buf[:, 0].sum()) == 0
