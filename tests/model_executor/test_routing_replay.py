"""Routing replay (R3 in a trainer's forward): forcing the experts a forward chose reproduces it bit for
bit, forcing other experts changes it, and the router's weights still get gradients."""

from __future__ import annotations

import pytest
import torch

from fastdeploy_r3.config import ModelConfig
from fastdeploy_r3.model_executor.forward_context import ForwardContext, RoutingReplay, set_forward_context
from fastdeploy_r3.model_executor.model_loader import load_model

ARCHS = ["qwen3_moe", "mixtral", "glm4_moe"]
TOKENS = torch.tensor([5, 77, 301, 12, 9, 140, 66, 2], dtype=torch.int64)


class _Recorder:
    def __init__(self, num_layers: int) -> None:
        self.ids: list[torch.Tensor | None] = [None] * num_layers

    def capture(self, moe_index: int, topk_ids: torch.Tensor) -> None:
        self.ids[moe_index] = topk_ids.clone()

    def rows(self) -> torch.Tensor:
        return torch.stack(self.ids, dim=1)  # [T, L, K]


def _forward(model, replay: RoutingReplay | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    rec = _Recorder(len(model.moe_layer_ids))
    with set_forward_context(ForwardContext(None, [], rec, routing_replay=replay)):
        positions = torch.arange(len(TOKENS))
        logits = model.compute_logits(model(TOKENS, positions))  # [T, V]
    return logits, rec.rows()


@pytest.fixture(scope="module", params=ARCHS)
def model(request, fake_model_dir):
    mc = ModelConfig(model=fake_model_dir(request.param), dtype="float32")
    return load_model(mc, torch.device("cpu"))


def test_replaying_the_chosen_experts_reproduces_the_forward_bit_for_bit(model) -> None:
    logits, rows = _forward(model)
    replayed_logits, replayed_rows = _forward(model, RoutingReplay(rows))
    assert torch.equal(replayed_rows, rows)  # the capture sees the forced experts
    assert torch.equal(replayed_logits, logits)


def test_replaying_other_experts_changes_the_forward(model) -> None:
    logits, rows = _forward(model)
    shifted = (rows + 1) % model.num_experts  # every token, every layer: K other distinct experts
    other_logits, other_rows = _forward(model, RoutingReplay(shifted))
    assert torch.equal(other_rows, shifted)
    assert (other_logits - logits).abs().max().item() > 1e-3


def test_the_router_gets_gradients_through_replayed_routing(model) -> None:
    _, rows = _forward(model)
    gate = next(m.gate.weight for m in model.modules() if hasattr(m, "replay_weights"))
    gate.requires_grad_(True)
    try:
        with set_forward_context(ForwardContext(None, [], None, routing_replay=RoutingReplay(rows))):
            logits = model.compute_logits(model(TOKENS, torch.arange(len(TOKENS))))
        torch.log_softmax(logits, dim=-1)[:, 3].sum().backward()
        assert gate.grad is not None and gate.grad.abs().sum().item() > 0
    finally:
        gate.requires_grad_(False)
        gate.grad = None


def test_replay_with_the_wrong_number_of_rows_is_refused(model) -> None:
    _, rows = _forward(model)
    with pytest.raises(ValueError, match="routing replay holds 7 rows but the forward has 8 tokens"):
        _forward(model, RoutingReplay(rows[:7]))
