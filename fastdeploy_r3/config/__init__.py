"""The configuration room: what an engine is asked to be, validated before anything starts.

    engine.py     EngineConfig and its parts (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig)
    cli.py        the engine's command-line flags, derived from the fields of those dataclasses
    hf_config.py  config.json / generation_config.json keys, normalised across the model families
    dtypes.py     the model dtype names and their torch dtypes (torch imported on first use)

The R3 settings (RoutingReplayConfig) live with the rest of R3 in r3/config.py; ConfigError in
fastdeploy_r3/errors.py, a leaf both rooms import (under config/ it would close the cycle config/ ->
r3/config.py -> config/). This room imports only those two and numpy; torch only inside functions.
"""

from __future__ import annotations

from fastdeploy_r3.config.cli import add_engine_args, engine_config_from_args
from fastdeploy_r3.config.engine import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from fastdeploy_r3.errors import ConfigError

__all__ = [
    "CacheConfig",
    "ConfigError",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "add_engine_args",
    "engine_config_from_args",
]
