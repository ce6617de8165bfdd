"""RoutingCapture: the per-step sink every MoE layer writes its top-k ids into."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdeploy_r3.model_executor.forward_context import ForwardContext, get_forward_context, set_forward_context
from fastdeploy_r3.r3.errors import RoutingReplayError, debug_rows
from fastdeploy_r3.worker.routing_capture import RoutingCapture

L, K, E = 3, 2, 16


def _capture(debug_mode: bool = False, num_experts: int = E) -> RoutingCapture:
    dtype = np.dtype(np.uint8) if num_experts <= 255 else np.dtype(np.uint16)
    return RoutingCapture(8, L, K, num_experts, dtype, debug_mode=debug_mode)


def _moe_forward(ids_per_layer: list[torch.Tensor]) -> None:
    """Stands in for the model: MoE layer i reports its [T, K] top-k through the forward context."""
    for moe_index, topk_ids in enumerate(ids_per_layer):
        get_forward_context().routing_capture.capture(moe_index, topk_ids)


def test_step_rows_are_the_captured_ids_of_every_layer() -> None:
    """5 real tokens, 3 MoE layers: rows [5, 3, 2] uint8 equal what each layer chose."""
    cap = _capture()
    ids = [torch.randint(0, E, (5, K)) for _ in range(L)]  # int64, as torch.topk returns
    cap.begin_step(5)
    with set_forward_context(ForwardContext(attn_metadata=None, kv_caches=[], routing_capture=cap)):
        _moe_forward(ids)
    cap.check_complete()
    rows = cap.step_rows(5)
    assert rows.dtype == np.uint8 and rows.shape == (5, L, K)
    assert np.array_equal(rows, torch.stack(ids, dim=1).numpy())


def test_padded_tokens_never_leave_the_buffer() -> None:
    """A graph-padded launch of 7 tokens for a step of 5 real ones: only 5 rows come out."""
    cap = _capture()
    ids = torch.arange(14).reshape(7, K) % E
    cap.begin_step(5)
    for i in range(L):
        cap.capture(i, ids)
    assert np.array_equal(cap.step_rows(5)[:, 1], ids[:5].numpy())
    assert cap.device_rows(5).shape == (5, L, K)


def test_missing_layer_fails_the_step() -> None:
    """Layer 1 never captured: check_complete and step_rows both refuse, naming it."""
    cap = _capture()
    cap.begin_step(2)
    cap.capture(0, torch.zeros(2, K, dtype=torch.int64))
    cap.capture(2, torch.zeros(2, K, dtype=torch.int64))
    with pytest.raises(RoutingReplayError, match=r"MoE layer\(s\) \[1\] did not capture"):
        cap.check_complete()
    with pytest.raises(RoutingReplayError, match=r"\[1\] did not capture"):
        cap.step_rows(2)


def test_each_step_starts_empty() -> None:
    """A complete step does not make the next one complete."""
    cap = _capture()
    cap.begin_step(1)
    for i in range(L):
        cap.capture(i, torch.zeros(1, K, dtype=torch.int64))
    cap.check_complete()
    cap.begin_step(1)
    with pytest.raises(RoutingReplayError, match=r"\[0, 1, 2\] did not capture"):
        cap.check_complete()
    cap.mark_graph_replay()  # a replayed graph ran every recorded capture
    cap.check_complete()


@pytest.mark.parametrize(
    ("moe_index", "shape", "match"),
    [
        (3, (4, K), r"MoE layer index 3 is outside \[0, 3\)"),
        (-1, (4, K), r"MoE layer index -1"),
        (0, (4, K + 1), r"expected \[T, 2\]"),
        (0, (4,), r"expected \[T, 2\]"),
        (0, (3, K), r"captured 3 tokens in a step of 4"),
        (0, (9, K), r"buffer holds 8"),
    ],
)
def test_bad_capture_is_refused(moe_index: int, shape: tuple[int, ...], match: str) -> None:
    """Out-of-range layer, wrong K, too few or too many tokens: nothing is written."""
    cap = _capture()
    cap.begin_step(4)
    with pytest.raises(RoutingReplayError, match=match):
        cap.capture(moe_index, torch.ones(shape, dtype=torch.int64))
    assert int(cap.buffer.abs().sum()) == 0


def test_capture_twice_and_outside_a_step_are_refused() -> None:
    cap = _capture()
    with pytest.raises(RoutingReplayError, match="outside a step"):
        cap.capture(0, torch.zeros(1, K, dtype=torch.int64))
    cap.begin_step(1)
    cap.capture(0, torch.zeros(1, K, dtype=torch.int64))
    with pytest.raises(RoutingReplayError, match="captured twice"):
        cap.capture(0, torch.zeros(1, K, dtype=torch.int64))
    with pytest.raises(RoutingReplayError, match="step of 9 tokens does not fit"):
        cap.begin_step(9)


@pytest.mark.parametrize("bad_id", [E, -1])
def test_expert_id_out_of_range_fails_the_step(bad_id: int) -> None:
    """Token 2, layer 1 reports expert 16 of 16 (or -1): no rows are returned."""
    cap = _capture()
    cap.begin_step(3)
    for i in range(L):
        ids = torch.zeros(3, K, dtype=torch.int64)
        if i == 1:
            ids[2, 0] = bad_id
        cap.capture(i, ids)
    with pytest.raises(RoutingReplayError, match=r"token 2 of the step got expert ids .* in MoE layer 1"):
        cap.step_rows(3)


def test_debug_mode_returns_positions_not_routing() -> None:
    """Debug mode, 300 experts (uint16): rows are position mod 65535 whatever the router chose."""
    cap = _capture(debug_mode=True, num_experts=300)
    positions = torch.tensor([298, 299, 300, 7])
    with pytest.raises(RoutingReplayError, match=r"debug mode needs positions \[4\]"):
        cap.begin_step(4)
    cap.begin_step(4, positions)
    for i in range(L):
        cap.capture(i, torch.randint(0, 300, (4, K)))
    rows = cap.step_rows(4)
    assert rows.dtype == np.uint16
    assert np.array_equal(rows, debug_rows(positions.numpy(), L, K, np.dtype(np.uint16)))
    assert rows[2, 0, 0] == 300
