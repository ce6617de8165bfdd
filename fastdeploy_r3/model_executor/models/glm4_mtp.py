"""GLM-4.5's draft (multi-token prediction, MTP) layer: checkpoint layer num_hidden_layers, served only
under {"method": "mtp"} speculative decoding (worker/mtp_drafter.py).

At position i it reads the target's final hidden state h_i and the embedding of the token at i + 1, and
its output predicts the token at i + 2:

    e = enorm(embed_tokens(token[i + 1]))          [T, H]
    h = hnorm(h_i)                                 [T, H]   the target's hidden state after its final norm
    x = eh_proj([e; h])                            [T, 2H] -> [T, H]
    x = decoder layer (attention over the draft layer's own KV, a GLM MoE block)
    g = shared_head.norm(x + residual)             [T, H]   fed back as h for the next draft
    logits = shared_head.head(g)                   [T, V]

Checkpoint names: model.layers.{L}.{enorm, hnorm, eh_proj, embed_tokens, shared_head.norm, shared_head.head}
and the decoder layer's usual self_attn.* / mlp.* / *_layernorm names; the module tree here is
`mtp.{L}.<same>` (Glm4MoeForCausalLM maps the two).

R3 INVARIANT: this layer's MoE block has moe_index num_moe_layers (past the policy's 0..L-1) and runs only
under a forward context without a routing capture (worker/mtp_drafter.py): its routing is the draft's,
never the policy's, and never becomes an R3 row.
"""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy_r3.model_executor.layers.moe import SparseMoeBlock
from fastdeploy_r3.model_executor.layers.norm import RMSNorm
from fastdeploy_r3.model_executor.layers.rotary import CosSin
from fastdeploy_r3.model_executor.layers.self_attention import SelfAttention
from fastdeploy_r3.model_executor.models.base import DecoderLayer

# the draft layer's own parts, named as the checkpoint names them (the rest is the decoder layer's)
DRAFT_PARTS = ("enorm", "hnorm", "eh_proj", "embed_tokens", "shared_head")


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)


class Glm4MoeMtpLayer(DecoderLayer):
    def __init__(self, self_attn: SelfAttention, mlp: SparseMoeBlock, hidden_size: int, vocab_size: int,
                 rms_norm_eps: float) -> None:
        super().__init__(self_attn, mlp, hidden_size, rms_norm_eps)
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.enorm = RMSNorm(hidden_size, rms_norm_eps)
        self.hnorm = RMSNorm(hidden_size, rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.shared_head = SharedHead(hidden_size, vocab_size, rms_norm_eps)

    def draft_forward(self, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """next_ids [T] (the token at each position + 1), positions [T], hidden [T, H] (the target's, or this
        layer's own output for a later draft) -> g [T, H], this layer's normed output (compute_logits(g)
        scores the token at position + 2). Runs inside a forward context whose KV caches are the draft
        layer's own, at index 0 (its attention's layer_idx)."""
        e = self.enorm(self.embed_tokens(next_ids))  # [T, H]
        x = self.eh_proj(torch.cat([e, self.hnorm(hidden)], dim=-1))  # [T, 2H] -> [T, H]
        cos_sin: CosSin = self.self_attn.rotary.cos_sin(positions)
        x, residual = self(positions, x, None, cos_sin)  # [T, H], [T, H]
        return self.shared_head.norm(x, residual)[0]  # [T, H]

    def compute_logits(self, g: torch.Tensor) -> torch.Tensor:
        """g [N, H] -> logits [N, V] float32."""
        return self.shared_head.head(g).float()
