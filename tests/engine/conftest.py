"""Fixtures for engine tests (fake checkpoints come from fake_model_dir in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture(scope="session")
def qwen3_dir(fake_model_dir: Callable[[str], str]) -> str:
    return fake_model_dir("qwen3_moe")
