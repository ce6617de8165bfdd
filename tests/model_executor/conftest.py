"""Fixtures for model-executor tests: tiny fake checkpoints (one per family, built once per session)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from fastdeploy_r3.model_executor.fake_model import make_fake_model


class ListRoutingSink:
    """RoutingCaptureSink that keeps every capture: calls[i] = (moe_index, topk_ids [T, K])."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.Tensor]] = []

    def capture(self, moe_index: int, topk_ids: torch.Tensor) -> None:
        self.calls.append((moe_index, topk_ids.clone()))

    def per_layer(self, num_moe_layers: int) -> list[torch.Tensor]:
        """[L] tensors [T_total, K]: the captures of each MoE layer concatenated over calls."""
        return [torch.cat([ids for i, ids in self.calls if i == layer]) for layer in range(num_moe_layers)]


@pytest.fixture(scope="session")
def fake_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """fake_model_dir(arch, preset="tiny", seed=0) -> directory of a cached fake checkpoint."""
    cache: dict[tuple[str, str, int], str] = {}

    def get(arch: str, preset: str = "tiny", seed: int = 0) -> str:
        key = (arch, preset, seed)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-{preset}-{seed}")
            cache[key] = make_fake_model(arch, str(out), preset=preset, seed=seed)
        return cache[key]

    return get


@pytest.fixture
def new_routing_sink() -> Callable[[], ListRoutingSink]:
    """Factory of fresh ListRoutingSink objects (test modules cannot import conftest)."""
    return ListRoutingSink
