"""MTP drafts (speculative decoding with GLM-4.5's draft layer, models/glm4_mtp.py), made in the worker
right after the target step they follow, and returned with its tokens (StepOutput.draft_token_ids).

The draft layer at position i reads the target's hidden state h_i and the token at i + 1; so once a step
has verified its tokens, the draft layer catches up over every position whose next token is now known,
and its output at the last of them (whose next token is the bonus token just sampled) drafts the token
after the bonus; k > 1 drafts feed each draft and the layer's own output back, one position at a time
(SGLang's NEXTN):

    target step: chunk c0 c1 c2 | drafts d1 d2 d3   positions s .. s+5, accepted d1 + bonus b
    catch-up:    pos   s   s+1  s+2  s+3          (s-1 too when a prefill chunk left it pending)
                 next  c1  c2   d1   b            hidden: the target's rows at those positions
    drafts:      x1 = argmax at s+3;  x2 from (x1, g_{s+3}) at s+4;  x3 from (x2, g_{s+4}) at s+5

Its KV cache is its own, paged, owned here (not the engine's blocks: draft positions run past the slots
the scheduler reserved): a request's draft blocks hold positions [base, next_pos), base being where its
draft state (re)started. A request whose chunk does not continue that state (the first chunk, a prefix
hit, a preemption, a re-run step) starts a new one at its chunk: the draft layer then attends to fewer
positions than the target, which lowers acceptance and nothing else. Draft-loop positions are written past
next_pos and overwritten by the next catch-up. Nothing here is published, swapped, cached or stored.

R3 INVARIANT: the draft layer runs under a forward context WITHOUT a routing capture, so its MoE routing
never becomes an R3 row (models/glm4_mtp.py); the target step wrote its rows before this runs.

Drafts are a pure function of the verified tokens and the target's hidden states, so what is drafted
changes how many tokens a step accepts, never which tokens or rows a request gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastdeploy_r3.model_executor.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from fastdeploy_r3.model_executor.models.glm4_mtp import Glm4MoeMtpLayer
from fastdeploy_r3.worker.messages import ScheduledRequestData


@dataclass
class DraftInputs:
    """What a launched target step hands the drafter: its hidden states and its layout."""

    hidden: torch.Tensor  # [T, H] the target's final (normed) hidden states
    requests: list[ScheduledRequestData]
    query_start_loc: list[int]  # [B + 1]


@dataclass
class _DraftState:
    base: int  # the position of local index 0 in blocks
    next_pos: int  # positions [base, next_pos) are in the draft layer's cache
    blocks: list[int] = field(default_factory=list)
    pending: torch.Tensor | None = None  # [H] the target's hidden at next_pos, its next token not yet known


@dataclass
class _Segment:
    """One request's catch-up positions in the draft forward."""

    request_id: str
    state: _DraftState
    positions: list[int]
    next_ids: list[int]
    hidden: list[torch.Tensor]  # [n, H] pieces
    drafts: bool  # its last next id is the token just sampled: draft after it


class MtpDrafter:
    def __init__(self, layer: Glm4MoeMtpLayer, num_drafts: int, block_size: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        attn = layer.self_attn
        self.layer, self.num_drafts, self.block_size = layer, num_drafts, block_size
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        self.kv_cache = (torch.zeros(shape, dtype=dtype, device=device),  # [NB, BS, KVH, D] k, v
                         torch.zeros(shape, dtype=dtype, device=device))
        self.device = device
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() takes the lowest id first
        self._states: dict[str, _DraftState] = {}

    def forget(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self._free.extend(reversed(state.blocks))

    @torch.inference_mode()
    def propose(self, batch: DraftInputs, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """Catch the draft layer up over the step's verified positions and draft up to num_drafts tokens
        after each sampled request's last token; sampled: the step's tokens per request (ModelRunner.finish)."""
        segments = [self._segment(batch, b, sampled) for b in range(len(batch.requests))]
        in_step = {r.request_id for r in batch.requests}
        segments = [s for s in segments if s.positions and self._reserve(s, in_step)]
        if not segments:
            return {}
        next_ids = torch.tensor([t for s in segments for t in s.next_ids], device=self.device)  # [N]
        hidden = torch.cat([torch.stack(s.hidden) for s in segments])  # [N, H]
        g = self._forward(segments, [s.positions for s in segments], next_ids, hidden)  # [N, H]
        drafting = [i for i, s in enumerate(segments) if s.drafts]
        if not drafting:
            return {}
        ends = torch.tensor([len(s.positions) for s in segments]).cumsum(0) - 1  # [B'] each segment's last row
        g = g[ends[drafting].to(g.device)]  # [D, H]
        tokens = self.layer.compute_logits(g).argmax(-1)  # [D] the token after each bonus
        drafts = [tokens]
        for j in range(1, self.num_drafts):  # draft j + 1 from draft j and the layer's own output
            positions = [[segments[i].positions[-1] + j] for i in drafting]
            g = self._forward([segments[i] for i in drafting], positions, tokens, g)  # [D, H]
            tokens = self.layer.compute_logits(g).argmax(-1)  # [D]
            drafts.append(tokens)
        table = torch.stack(drafts, dim=1).tolist()  # [D, k]
        return {segments[i].request_id: table[n] for n, i in enumerate(drafting)}

    def _segment(self, batch: DraftInputs, b: int, sampled: dict[str, list[int]]) -> _Segment:
        """Request b's catch-up positions; its state moves past them (dropped if _reserve then fails)."""
        r = batch.requests[b]
        rid, s, q0 = r.request_id, r.start_pos, batch.query_start_loc[b]
        num_real = len(r.token_ids) - (r.num_sample_rows - 1 if r.sample else 0)  # the chunk without its drafts
        state = self._states.get(rid)
        # the chunk continues the state when it starts at next_pos, or right after the pending position
        if state is None or state.next_pos + (state.pending is not None) != s:
            self.forget(rid)  # a new draft state at this chunk (see the module docstring)
            state = self._states[rid] = _DraftState(base=s, next_pos=s)
        seg = _Segment(rid, state, [], [], [], drafts=r.sample and rid in sampled)
        if state.pending is not None:  # the previous chunk's last position, its next token now known
            seg.positions.append(s - 1)
            seg.next_ids.append(r.token_ids[0])
            seg.hidden.append(state.pending)
        # the chunk's own next tokens, then the accepted drafts (equal to those fed) and the bonus
        known = list(r.token_ids[1:num_real]) + (sampled[rid] if seg.drafts else [])
        for i, tok in enumerate(known):
            seg.positions.append(s + i)
            seg.next_ids.append(tok)
            seg.hidden.append(batch.hidden[q0 + i])
        # INVARIANT: pending is the target's hidden state at next_pos, held while its next token is unknown
        state.pending = None if seg.drafts else batch.hidden[q0 + num_real - 1].clone()  # [H]
        state.next_pos = s + len(known)
        return seg

    def _reserve(self, seg: _Segment, in_step: set[str]) -> bool:
        """Blocks for the segment's positions and its draft loop; False (its state dropped) if none are left."""
        last = seg.positions[-1] + (self.num_drafts - 1 if seg.drafts else 0)
        need = (last - seg.state.base) // self.block_size + 1 - len(seg.state.blocks)
        if need > len(self._free):
            for rid in [r for r in self._states if r not in in_step]:  # idle requests' states go first
                self.forget(rid)
        if need > len(self._free):
            self.forget(seg.request_id)
            return False
        seg.state.blocks.extend(self._free.pop() for _ in range(max(need, 0)))
        return True

    def _forward(self, segments: list[_Segment], positions: list[list[int]], next_ids: torch.Tensor,
                 hidden: torch.Tensor) -> torch.Tensor:
        """The draft layer over each segment's positions (ascending, contiguous), attending to its state's
        cache: next_ids [N], hidden [N, H] -> g [N, H]."""
        bs = self.block_size
        query_lens = [len(p) for p in positions]
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        local = [[p - s.state.base for p in ps] for s, ps in zip(segments, positions)]
        slots = [s.state.blocks[i // bs] * bs + i % bs for s, idx in zip(segments, local) for i in idx]
        width = max(len(s.state.blocks) for s in segments)
        tables = torch.zeros(len(segments), width, dtype=torch.int64)  # [B', MB] padded with 0
        for b, s in enumerate(segments):
            tables[b, : len(s.state.blocks)] = torch.tensor(s.state.blocks)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=self.device), query_start_loc=qsl, query_lens=query_lens,
            seq_lens=[idx[-1] + 1 for idx in local], block_tables=tables.to(self.device), block_size=bs,
        )
        pos = torch.tensor([p for ps in positions for p in ps], device=self.device)  # [N]
        # no routing capture: the draft layer's MoE never writes an R3 row (the module docstring)
        with set_forward_context(ForwardContext(meta, [self.kv_cache], routing_capture=None)):
            return self.layer.draft_forward(next_ids, pos, hidden)


def make_mtp_drafter(model: torch.nn.Module, num_drafts: int, block_size: int, num_gpu_blocks: int,
                     max_num_seqs: int, dtype: torch.dtype, device: torch.device) -> MtpDrafter:
    """The drafter of a model built with its draft layer. Its cache holds as many blocks as the target's
    (ModelRunner.kv_bytes_per_block counts the draft layer as one more layer) plus each running request's
    draft-loop positions, which run up to k - 1 past its last verified one."""
    layer = getattr(model, "draft_layer", None)
    if not isinstance(layer, Glm4MoeMtpLayer):
        raise RuntimeError("MTP drafts need the model built with its draft layer (load_model with_draft_layers)")
    extra = max_num_seqs * (-(-num_drafts // block_size) + 1)
    return MtpDrafter(layer, num_drafts, block_size, num_gpu_blocks + extra, dtype, device)
