"""Fixtures for engine tests: one tiny fake checkpoint per family, built once per session."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fastdeploy_r3.model_executor.fake_model import make_fake_model


@pytest.fixture(scope="session")
def fake_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """fake_model_dir(family) -> directory of a tiny fake checkpoint of that family (seed 0)."""
    cache: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in cache:
            cache[family] = make_fake_model(family, str(tmp_path_factory.mktemp(f"{family}-tiny")), preset="tiny")
        return cache[family]

    return get


@pytest.fixture(scope="session")
def qwen3_dir(fake_model_dir: Callable[[str], str]) -> str:
    return fake_model_dir("qwen3_moe")
