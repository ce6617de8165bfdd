"""The device KV pool is what memory holds, capped by what the engine can use (worker/kv_budget.py): a
tiny model given a huge budget starts with a pool its sequences can fill, not tens of millions of blocks."""

from __future__ import annotations

from types import SimpleNamespace

from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.worker.kv_budget import MAX_BLOCKS, PREFIX_CACHE_HEADROOM, num_kv_blocks, usable_blocks
from fastdeploy_r3.worker.model_runner import ModelRunner


def test_the_cap_is_every_sequence_at_full_length_times_the_headroom() -> None:
    # 4 sequences of 10 tokens in blocks of 4: 3 blocks each, 12 in all, x4 for cached prefixes
    assert usable_blocks(4, 10, 4) == 4 * 3 * PREFIX_CACHE_HEADROOM == 48
    assert usable_blocks(256, 40960, 16) == MAX_BLOCKS  # 2.6M blocks asked: the absolute cap
    assert usable_blocks(4, None, 4) == MAX_BLOCKS  # no length known: only the absolute cap


def test_memory_decides_below_the_cap_and_the_cap_above_it() -> None:
    assert num_kv_blocks(10 * 1024, 1024, cap=48) == 10
    assert num_kv_blocks(120 * 2**30, 2048, cap=48) == 48  # a 2 KB block on 120 GB: 63M blocks otherwise


def test_a_tiny_model_with_a_huge_budget_gets_the_capped_pool(fake_model_dir) -> None:  # noqa: ANN001
    config = EngineConfig.from_kwargs(fake_model_dir("qwen3_moe"), block_size=4, max_num_seqs=4, max_model_len=10,
                                      kv_cache_space_gib=64.0)  # fmt: skip
    runner = ModelRunner(config, 0, 1, "kvbudget")
    # the tiny model's shapes, without loading it: 2 layers, K and V, 4 slots, 2 heads of 16 float32
    runner.model = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=16)
    assert runner.kv_bytes_per_block() == 2 * 2 * 4 * 2 * 16 * 4
    assert runner.determine_num_gpu_blocks() == 48  # 64 GiB would hold 64 * 2**30 / 2048 = 33.5M blocks
