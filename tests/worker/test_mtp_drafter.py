"""The MTP drafter's paged catch-up equals the draft layer run once over the whole history.

The transformers-written 4-layer GLM with a random draft layer (tests/hf_checkpoints.py), so every input
counts: the target's hidden state, the next token, the draft layer's attention over its own cache;
float32, block_size 4. The
target's hidden states come from one cache-free forward over the 18 tokens; the drafter sees them as the
engine would feed them:

    step 1   prefill t0..t7          no draw: the draft layer holds 0..6, position 7 pending
    step 2   prefill t8..t12         draws t13: catch-up 7..12, drafts after t13
    step 3   t13 + drafts t14..t16   accepts them and draws t17: catch-up 13..16, drafts after t17

Reference: the draft layer over positions 0..16 (next ids t1..t17) in one causal forward, its argmax at
16, then one position more per later draft, feeding the draft and the layer's own output back.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from fastdeploy_r3.config import ModelConfig
from fastdeploy_r3.model_executor.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from fastdeploy_r3.model_executor.model_loader import load_model
from fastdeploy_r3.worker.messages import ScheduledRequestData
from fastdeploy_r3.worker.mtp_drafter import DraftInputs, MtpDrafter

BS, K = 4, 3
TOKENS = torch.Generator().manual_seed(5)


@pytest.fixture(scope="module")
def model(hf_checkpoint_dir: Callable[[str], str]) -> torch.nn.Module:
    return load_model(ModelConfig(model=hf_checkpoint_dir("glm4_moe")), torch.device("cpu"), with_draft_layers=True)


class _NoCapture:
    def capture(self, moe_index: int, topk_ids: torch.Tensor) -> None:
        raise AssertionError(f"MoE block {moe_index} captured routing inside the drafter")


def _chunk(tokens: list[int], start: int, sample: bool, num_sample_rows: int = 1) -> ScheduledRequestData:
    return ScheduledRequestData("a", tokens, start, [], [], sample, num_sample_rows=num_sample_rows)


@torch.inference_mode()
def test_paged_catch_up_and_drafts_equal_one_causal_forward(model: torch.nn.Module) -> None:
    tokens = torch.randint(0, 256, (18,), generator=TOKENS)
    with set_forward_context(ForwardContext(None, [])):
        hidden = model(tokens, torch.arange(18))  # [18, H] the target's, cache-free
        layer = model.draft_layer
        g = layer.draft_forward(tokens[1:18], torch.arange(17), hidden[:17])  # [17, H]
        want, prev, g_last = [], None, g[16:17]
        for j in range(K):
            if prev is not None:  # one position more: the previous draft and the layer's own output
                ids = torch.cat([tokens[1:18], torch.tensor(want)])  # [17 + j]
                hid = torch.cat([hidden[:17], *prev])
                g_last = layer.draft_forward(ids, torch.arange(17 + j), hid)[-1:]
                prev.append(g_last)
            else:
                prev = [g_last]
            want.append(int(layer.compute_logits(g_last).argmax()))

    drafter = MtpDrafter(layer, K, BS, num_blocks=12, dtype=torch.float32, device=torch.device("cpu"))
    t = tokens.tolist()
    # an ambient capture that fails on use: the drafter's own forward context has none
    with set_forward_context(ForwardContext(None, [], routing_capture=_NoCapture())):
        assert drafter.propose(DraftInputs(hidden[0:8], [_chunk(t[0:8], 0, False)], [0, 8]), {}) == {}
        first = drafter.propose(DraftInputs(hidden[8:13], [_chunk(t[8:13], 8, True)], [0, 5]), {"a": [t[13]]})
        assert len(first["a"]) == K
        got = drafter.propose(DraftInputs(hidden[13:17], [_chunk(t[13:17], 13, True, 4)], [0, 4]),
                              {"a": t[14:18]})
    assert got == {"a": want}
    # and its cache holds what the one forward computes for positions 0..16 (every hidden row and next id)
    blocks = drafter._states["a"].blocks
    for held, ref in zip(drafter.kv_cache, _one_paged_forward(layer, tokens[1:18], hidden[:17])):
        torch.testing.assert_close(held[blocks].flatten(0, 1)[:17], ref, rtol=1e-5, atol=1e-6)

    drafter.forget("a")
    assert sorted(drafter._free) == list(range(12))  # every block back


def _one_paged_forward(layer: torch.nn.Module, next_ids: torch.Tensor, hidden: torch.Tensor) -> list[torch.Tensor]:
    """The draft layer over positions 0..N-1 in one step into a fresh paged cache -> its K and V [N, KVH, D]."""
    n, attn = len(next_ids), layer.self_attn
    shape = (-(-n // BS), BS, attn.num_kv_heads, attn.head_dim)
    cache = (torch.zeros(shape), torch.zeros(shape))
    meta = AttentionMetadata(slot_mapping=torch.arange(n), query_start_loc=[0, n], query_lens=[n], seq_lens=[n],
                             block_tables=torch.arange(shape[0])[None], block_size=BS)
    with set_forward_context(ForwardContext(meta, [cache])):
        layer.draft_forward(next_ids, torch.arange(n), hidden)
    return [c.flatten(0, 1)[:n] for c in cache]


@torch.inference_mode()
def test_a_request_that_does_not_fit_gets_no_drafts(model: torch.nn.Module) -> None:
    """Two blocks of 4 hold positions 0..7: a 9-token prompt plus 2 draft positions needs three."""
    tokens = torch.randint(0, 256, (10,), generator=TOKENS)
    with set_forward_context(ForwardContext(None, [])):
        hidden = model(tokens, torch.arange(10))
    drafter = MtpDrafter(model.draft_layer, K, BS, num_blocks=2, dtype=torch.float32, device=torch.device("cpu"))
    t = tokens.tolist()
    assert drafter.propose(DraftInputs(hidden[:9], [_chunk(t[:9], 0, True)], [0, 9]), {"a": [t[9]]}) == {}
    assert sorted(drafter._free) == [0, 1]  # its state was dropped, nothing held
