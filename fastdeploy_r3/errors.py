"""Errors shared by the configuration modules (config/, r3/config.py) and everything that reads them."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is wrong; the message says which and what to change."""


class WeightLoadingError(ValueError):
    """A checkpoint does not match the model built from its config.json (models/base.py raises it; the FP8
    weight stream in model_executor/quantization/ too, which is why it lives here)."""
