"""The router logits of a CPU float32 forward, for GPU tests that forgive R3 differences only at router
near-ties (a CUDA kernel may order two scores a few ulps apart the other way)."""

from __future__ import annotations

import torch

from fastdeploy_r3.config import ModelConfig
from fastdeploy_r3.model_executor.forward_context import ForwardContext, set_forward_context
from fastdeploy_r3.model_executor.layers.moe import SparseMoeBlock
from fastdeploy_r3.model_executor.model_loader import load_model


def cpu_router_logits(model_dir: str, token_ids: list[int]) -> list[tuple[SparseMoeBlock, torch.Tensor]]:
    """Per MoE layer, in layer order: its block and its gate's logits [T, E] for `token_ids` (one forward
    without KV cache)."""
    model = load_model(ModelConfig(model_dir, dtype="float32"), torch.device("cpu"))
    moe = sorted((m for m in model.modules() if isinstance(m, SparseMoeBlock)), key=lambda m: m.moe_index)
    logits: dict[int, torch.Tensor] = {}
    hooks = [m.gate.register_forward_hook(lambda _m, _i, out, i=m.moe_index: logits.__setitem__(i, out)) for m in moe]
    try:
        with torch.no_grad(), set_forward_context(ForwardContext(attn_metadata=None, kv_caches=[])):
            model(torch.tensor(token_ids, dtype=torch.int64), torch.arange(len(token_ids)))
    finally:
        for h in hooks:
            h.remove()
    return [(m, logits[m.moe_index]) for m in moe]
