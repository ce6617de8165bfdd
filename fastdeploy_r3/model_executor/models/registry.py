"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

import importlib

from torch import nn

from fastdeploy_r3.config import ConfigError
from fastdeploy_r3.config.hf_config import SUPPORTED_ARCHITECTURES


def get_model_class(architecture: str) -> type[nn.Module]:
    module = SUPPORTED_ARCHITECTURES.get(architecture)
    if module is None:
        raise ConfigError(
            f"unknown architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return getattr(importlib.import_module(f"fastdeploy_r3.model_executor.models.{module}"), architecture)
