"""Fixtures for model-executor tests (fake checkpoints: fake_model_dir in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


class ListRoutingSink:
    """RoutingCaptureSink that keeps every capture: calls[i] = (moe_index, topk_ids [T, K])."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.Tensor]] = []

    def capture(self, moe_index: int, topk_ids: torch.Tensor) -> None:
        self.calls.append((moe_index, topk_ids.clone()))

    def per_layer(self, num_moe_layers: int) -> list[torch.Tensor]:
        """[L] tensors [T_total, K]: the captures of each MoE layer concatenated over calls."""
        return [torch.cat([ids for i, ids in self.calls if i == layer]) for layer in range(num_moe_layers)]


@pytest.fixture
def new_routing_sink() -> Callable[[], ListRoutingSink]:
    """Factory of fresh ListRoutingSink objects (test modules cannot import conftest)."""
    return ListRoutingSink
