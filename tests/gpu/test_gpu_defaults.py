"""The scheduler sizes a CUDA engine picks when no flag sets them (config/scheduler_defaults.py), on
the real device. CI has no GPU: tests/gpu/conftest.py skips these there. Run through the device tool:

    python -m pytest -m gpu tests/gpu/test_gpu_defaults.py -v
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from fastdeploy_r3.config import EngineConfig

pytestmark = pytest.mark.gpu


def test_a_tiny_model_on_an_h200_class_gpu_gets_256_sequences_and_8k_tokens(
    fake_model_dir: Callable[..., str],
) -> None:
    """A tiny model leaves the whole device to KV: the GPU caps (256 / 8192), not the cache, decide."""
    config = EngineConfig.from_kwargs(fake_model_dir("qwen3_moe"), device="cuda", dtype="bfloat16")
    budget = config.device_budget()
    assert budget.memory_bytes == torch.cuda.get_device_properties(0).total_memory
    assert budget.num_kv_blocks() > 256
    assert (config.scheduler_config.max_num_seqs, config.scheduler_config.max_num_batched_tokens) == (256, 8192)
    given = EngineConfig.from_kwargs(fake_model_dir("qwen3_moe"), device="cuda", max_num_seqs=3)
    assert given.scheduler_config.max_num_seqs == 3
