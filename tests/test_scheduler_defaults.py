"""max_num_seqs / max_num_batched_tokens defaults per device (config/scheduler_defaults.py), derived
from a described device, not a real one: the CPU keeps small batches, a GPU gets 256 / 8192 capped by
what its KV cache holds, and a flag given explicitly always wins."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.config.scheduler_defaults import (
    DeviceBudget,
    kv_bytes_per_token,
    scheduler_defaults,
    weight_bytes_estimate,
)

GIB = 1 << 30
# Qwen3-30B-A3B's config.json sizes (48 layers, all MoE; 128 experts of 768; 4 KV heads of 128)
QWEN3_30B_A3B = {
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "moe_intermediate_size": 768, "intermediate_size": 6144,
    "vocab_size": 151936, "tie_word_embeddings": False,
}


def _qwen3_budget(memory_bytes: int, **kw: object) -> DeviceBudget:
    hf = QWEN3_30B_A3B
    return DeviceBudget("cuda", memory_bytes=memory_bytes, memory_utilization=0.9,
                        weight_bytes=weight_bytes_estimate(hf, list(range(48)), 2, 1),
                        kv_bytes_per_token=kv_bytes_per_token(hf, 2, 1), block_size=16, **kw)  # type: ignore[arg-type]


def test_cpu_keeps_small_batches() -> None:
    assert scheduler_defaults(DeviceBudget("cpu"), max_model_len=512, chunked_prefill=True) == (64, 2048)
    # without chunked prefill a whole prompt must fit one step
    assert scheduler_defaults(DeviceBudget("cpu"), max_model_len=4096, chunked_prefill=False) == (64, 4096)


def test_the_estimates_match_qwen3_30b_a3b_in_bf16() -> None:
    """30.5 B parameters (61 GB in bf16); K and V of 48 layers x 4 heads x 128 = 96 KiB a token."""
    assert weight_bytes_estimate(QWEN3_30B_A3B, list(range(48)), 2, 1) / 1e9 == pytest.approx(61.0, rel=0.01)
    assert kv_bytes_per_token(QWEN3_30B_A3B, 2, 1) == 96 * 1024
    assert kv_bytes_per_token(QWEN3_30B_A3B, 2, 4) == 24 * 1024  # one KV head per rank at TP 4


def test_an_h200_gets_256_sequences_and_8k_tokens() -> None:
    """141 GB x 0.9 - 61 GB of weights leaves ~42k blocks of 16 tokens: far above the caps."""
    budget = _qwen3_budget(141 * 10**9)
    assert 40_000 < budget.num_kv_blocks() < 45_000
    assert scheduler_defaults(budget, max_model_len=40960, chunked_prefill=True) == (256, 8192)
    assert scheduler_defaults(budget, max_model_len=40960, chunked_prefill=False) == (256, 40960)


def test_a_gpu_with_little_kv_room_is_capped_by_its_blocks() -> None:
    """Weights + 150 blocks' worth of KV in 90 % of the memory: 150 sequences, 2400 tokens."""
    hf = QWEN3_30B_A3B
    weights, per_block = weight_bytes_estimate(hf, list(range(48)), 2, 1), kv_bytes_per_token(hf, 2, 1) * 16
    budget = _qwen3_budget(int((weights + 150 * per_block) / 0.9) + 1)
    assert budget.num_kv_blocks() == 150
    assert scheduler_defaults(budget, max_model_len=40960, chunked_prefill=True) == (150, 2400)
    # the exact block count, when given, replaces the estimate
    assert scheduler_defaults(_qwen3_budget(141 * 10**9, num_gpu_blocks_override=40), 40960, True) == (40, 640)


def test_engine_config_settles_what_was_left_unset_and_keeps_what_was_given(
    fake_model_dir: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = fake_model_dir("qwen3_moe")
    cpu = EngineConfig.from_kwargs(model, device="cpu")
    assert (cpu.scheduler_config.max_num_seqs, cpu.scheduler_config.max_num_batched_tokens) == (64, 2048)
    # a CUDA device described, not present: 100 blocks of KV room
    monkeypatch.setattr(EngineConfig, "device_budget",
                        lambda self: DeviceBudget("cuda", num_gpu_blocks_override=100, block_size=16))
    gpu = EngineConfig.from_kwargs(model, device="cuda")
    assert (gpu.scheduler_config.max_num_seqs, gpu.scheduler_config.max_num_batched_tokens) == (100, 1600)
    given = EngineConfig.from_kwargs(model, device="cuda", max_num_seqs=8)
    assert (given.scheduler_config.max_num_seqs, given.scheduler_config.max_num_batched_tokens) == (8, 1600)
    both = EngineConfig.from_kwargs(model, device="cuda", max_num_seqs=300, max_num_batched_tokens=20000)
    assert (both.scheduler_config.max_num_seqs, both.scheduler_config.max_num_batched_tokens) == (300, 20000)
