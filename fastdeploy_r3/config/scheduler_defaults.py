"""Defaults of max_num_seqs and max_num_batched_tokens for the device the engine runs on.

    device  max_num_seqs                        max_num_batched_tokens
    cpu     64                                  2048
    cuda    256, capped by the KV cache:        8192 (max_model_len without chunked prefill),
            every running request holds a       capped by the KV cache's tokens
            block of its own

On a GPU a decode step costs about the same from 1 to a few hundred requests (it reads the weights
once), so throughput needs a large batch: vLLM and SGLang run 256+ sequences and chunk prefills at
8k-16k tokens. A CPU step's cost grows with every token, so small batches keep latency sane there.
A flag given explicitly always wins (EngineConfig resolves only what was left unset).

The KV cache's size is known exactly only after the worker has loaded the weights and profiled its
memory (worker/), after the config is frozen. The cap uses an estimate from config.json instead:
(device memory x gpu_memory_utilization - weight bytes) / KV bytes per token, or the exact
--num-gpu-blocks-override when given. The estimate only has to be right in order of magnitude: it
keeps a small GPU with a large model from scheduling more requests than it has blocks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CPU_MAX_NUM_SEQS = 64
CPU_MAX_NUM_BATCHED_TOKENS = 2048
GPU_MAX_NUM_SEQS = 256
GPU_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class DeviceBudget:
    """What the defaults depend on, so they can be derived (and tested) without the device."""

    kind: str  # "cpu" | "cuda"
    memory_bytes: int = 0  # total memory of one device (cuda)
    memory_utilization: float = 0.9
    weight_bytes: int = 0  # per device
    kv_bytes_per_token: int = 1
    block_size: int = 16
    num_gpu_blocks_override: int | None = None

    def num_kv_blocks(self) -> int:
        """KV blocks the device holds: the override, else the estimate (at least 1)."""
        if self.num_gpu_blocks_override is not None:
            return self.num_gpu_blocks_override
        free = self.memory_bytes * self.memory_utilization - self.weight_bytes
        return max(1, int(free // (self.kv_bytes_per_token * self.block_size)))


def scheduler_defaults(budget: DeviceBudget, max_model_len: int, chunked_prefill: bool) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) for a device, when neither flag was given."""
    if budget.kind != "cuda":
        tokens = CPU_MAX_NUM_BATCHED_TOKENS if chunked_prefill else max(CPU_MAX_NUM_BATCHED_TOKENS, max_model_len)
        return CPU_MAX_NUM_SEQS, tokens
    blocks = budget.num_kv_blocks()
    seqs = max(1, min(GPU_MAX_NUM_SEQS, blocks))
    tokens = min(GPU_MAX_NUM_BATCHED_TOKENS, blocks * budget.block_size)
    if not chunked_prefill:
        tokens = max(tokens, max_model_len)  # a whole prompt must fit one step
    return seqs, max(tokens, seqs)  # a decode step of every running request fits


def weight_bytes_estimate(hf: dict[str, Any], moe_layer_ids: list[int], dtype_bytes: int, tp: int) -> int:
    """Bytes of one tensor-parallel rank's weights, from config.json's sizes (norms and biases left out)."""
    h, layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads", heads))
    head_dim = int(hf.get("head_dim") or h // heads)
    experts = int(hf.get("num_experts") or hf.get("n_routed_experts") or hf.get("num_local_experts") or 0)
    moe_inter = int(hf.get("moe_intermediate_size") or hf.get("intermediate_size") or 0)
    inter = int(hf.get("intermediate_size") or moe_inter)
    shared = int(hf.get("n_shared_experts") or 0) * moe_inter + int(hf.get("shared_expert_intermediate_size") or 0)
    attention = h * head_dim * (2 * heads + 2 * kv_heads)
    moe = experts * 3 * h * moe_inter + h * experts + 3 * h * shared
    dense = 3 * h * inter
    num_moe = len(moe_layer_ids)
    params = layers * attention + num_moe * moe + (layers - num_moe) * dense
    vocab = int(hf["vocab_size"])
    params += vocab * h * (1 if hf.get("tie_word_embeddings") else 2)
    return params * dtype_bytes // tp


def kv_bytes_per_token(hf: dict[str, Any], dtype_bytes: int, tp: int) -> int:
    """K and V of every layer for one token, on one tensor-parallel rank."""
    heads = int(hf["num_attention_heads"])
    kv_heads = max(1, int(hf.get("num_key_value_heads", heads)) // tp)
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
    return 2 * int(hf["num_hidden_layers"]) * kv_heads * head_dim * dtype_bytes
