"""Errors shared by the configuration modules (config/, r3/config.py) and everything that reads them."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is wrong; the message says which and what to change."""
