"""Deterministic (batch-invariant) inference: a token's bits must not depend on which other tokens share
its step, nor on how its own prompt was chunked or found in the prefix cache.

Where the default kernels break that, and what this mode runs instead:

    op                      default                                      batch-invariant
    dense GEMMs, router,    one GEMM over all T rows: the BLAS / cuBLAS  CPU: BLAS calls of one shape,
    lm_head                 picks its kernel (reduction order) by T      [ROW_TILE, I] x [I, O]; Triton:
                                                                         ops/invariant_matmul.py
    expert GEMMs            CPU: one GEMM per expert over its rows;      CPU: the same fixed row tiles;
                            CUDA: grouped_mm or Triton tiles by T        CUDA: Triton, one tile config
    attention               CPU: einsums over a request's queries;       CPU: per query, KV tiles at fixed
                            CUDA: decode split count set by the batch's  absolute positions; CUDA:
                            longest sequence, prefill BLOCK_M by its     ops/invariant_attention.py for
                            longest chunk                                every step, partitions of fixed
                                                                         positions, one tile shape
    silu, sigmoid router,   CPU: a vectorized loop ends in a scalar      CPU: fixed [EW_TILE, N] tiles
    rotary cos / sin        tail placed by the tensor's size             (invariant_rows); CUDA: as is
    norms, softmax, top-k,  row-local already (one row's reduction       unchanged
    sampler, logprobs       never reads another row; the sampler's
                            noise is counter-based: worker/sample/draw.py)

Measured on this CPU (torch 2.13, MKL/oneDNN, 2 threads): float32 F.linear of the same first row gives
other bits for T = 1, 2 and 16 (a third of the outputs differ for I=64..1024); bf16 (float32 accumulation
rounded to bf16) hides most of it but not all (one output of 1024 flips from T=33 on). Within one call
of a fixed shape a row's result does not depend on its position or on the other rows, which is what
the row tiles rely on; tests/model_executor/test_batch_invariant.py checks both facts.

A token's computation then reads only its own row and the KV of its own earlier positions, in an order
fixed by its position: chunked prefill, a prefix-cache hit and a recompute give the same bits, so the
scheduler's chunk boundaries need not be fixed.

make_batch_invariant(model) switches a built model to these paths (the model loader calls it under
ModelConfig.enable_deterministic_inference). Its cost on the CPU: padding every GEMM to whole ROW_TILE rows,
one GEMM launch per tile, and the per-request attention loop; on CUDA: Triton GEMMs in place of cuBLAS's
shape-tuned ones (docs/deterministic.md has the H200 figures).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fastdeploy_r3.model_executor.forward_context import AttentionMetadata
from fastdeploy_r3.model_executor.layers.attention import Attention, AttentionBackend, paged_attention_loop
from fastdeploy_r3.model_executor.ops.invariant_attention import packed_paged_attention
from fastdeploy_r3.model_executor.ops.invariant_matmul import invariant_matmul
from fastdeploy_r3.model_executor.ops.kv_cache_write import write_kv_cache
from fastdeploy_r3.model_executor.ops.triton_setup import use_triton

ROW_TILE = 16  # rows of every batch-invariant GEMM call
KV_TILE = 16  # KV positions per attention step; tile j always covers positions [16 j, 16 j + 16)
TRITON_KV_TILE = 64  # the same, in the Triton kernel (ops/invariant_attention.py)
EW_TILE = 64  # rows of every batch-invariant elementwise call on the CPU (invariant_rows)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose every row is computed by a GEMM of one fixed shape, x [..., I] -> [..., O].

    Where Triton runs: one launch of ops/invariant_matmul.py (fixed tiles inside the kernel). Elsewhere
    the BLAS called on [ROW_TILE, I] x [I, O] tiles, the last one padded with zero rows, so the kernel
    (and its reduction order) never depends on how many rows share the call."""
    if use_triton(x):
        return invariant_matmul(x, weight, bias)
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])  # [T, I]
    num_rows = rows.shape[0]
    pad = -num_rows % ROW_TILE
    if pad:
        rows = F.pad(rows, (0, 0, 0, pad))  # [T', I], T' a multiple of ROW_TILE
    tiles = [F.linear(tile, weight, bias) for tile in rows.split(ROW_TILE)]  # each [ROW_TILE, O]
    out = torch.cat(tiles)[:num_rows] if tiles else rows.new_empty(0, weight.shape[0])  # [T, O]
    return out.reshape(*lead, weight.shape[0])


def invariant_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    """fn, an elementwise op (silu, sigmoid, cos, ...), on x [..., N]; batch_invariant on the CPU: applied to
    contiguous [EW_TILE, N] tiles, the last one zero-padded.

    A CPU elementwise loop takes its last numel % (2 x vector width) elements through a scalar path whose
    exp / sin differ from the vector ones in the last bit (sigmoid of a [T, 16] tensor: other bits in row 0
    for T = 1, 5, 7, ...), and which elements those are depends on the tensor's size. A tile of EW_TILE rows
    holds a whole number of vector loops (64 N elements), so none are. On CUDA every element runs the same
    function at any size."""
    if not batch_invariant or x.is_cuda:
        return fn(x)
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])  # [T, N]
    num_rows = rows.shape[0]
    rows = F.pad(rows, (0, 0, 0, -num_rows % EW_TILE))  # [T', N], a fresh contiguous tensor
    out = torch.cat([fn(tile) for tile in rows.split(EW_TILE)]) if num_rows else fn(rows)  # [T', N]
    return out[:num_rows].reshape(*lead, x.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           batch_invariant: bool) -> torch.Tensor:  # fmt: skip
    """F.linear, or invariant_linear where the layer runs batch-invariant."""
    return invariant_linear(x, weight, bias) if batch_invariant else F.linear(x, weight, bias)


class RowTiledLinear(nn.Linear):
    """nn.Linear through invariant_linear (the router gate, lm_head). make_batch_invariant turns an
    nn.Linear into one in place, so its parameters, buffers and names stay what the loader and the weight
    updates address."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Q, H, D] are the LAST Q positions of a context k, v [S, KVH, D] -> [Q, H, D] (q's dtype).

    Each query's result depends on its position and the context up to it only: queries go in fixed
    tiles of ROW_TILE, the context in KV tiles at fixed absolute positions, every product has one shape,
    and a tile past a query's position is masked whole (it then adds exactly 0 and rescales by exactly 1).
    Accumulates in float32.

        context  |0 ........ 15|16 ....... 31|32 .. S-1  pad|
        query at position p reads tiles 0 .. p // KV_TILE, positions > p masked
    """
    num_q, num_heads, head_dim = q.shape
    num_ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    kf = F.pad(k.float().repeat_interleave(group, dim=1), (0, 0, 0, 0, 0, -num_ctx % KV_TILE))  # [S', H, D]
    vf = F.pad(v.float().repeat_interleave(group, dim=1), (0, 0, 0, 0, 0, -num_ctx % KV_TILE))  # [S', H, D]
    kf, vf = kf.transpose(0, 1), vf.transpose(0, 1)  # [H, S', D]
    qf = F.pad(q.float(), (0, 0, 0, 0, 0, -num_q % ROW_TILE)).transpose(0, 1)  # [H, Q', D]
    out = torch.empty(num_heads, qf.shape[1], head_dim, dtype=torch.float32, device=q.device)  # [H, Q', D]
    offsets = torch.arange(KV_TILE, device=q.device)  # [KV_TILE]
    for q0 in range(0, num_q, ROW_TILE):
        q_tile = qf[:, q0 : q0 + ROW_TILE]  # [H, RT, D]
        q_pos = num_ctx - num_q + q0 + torch.arange(ROW_TILE, device=q.device)  # [RT]
        m = torch.full((num_heads, ROW_TILE), float("-inf"), device=q.device)  # [H, RT] running max
        denom = torch.zeros(num_heads, ROW_TILE, device=q.device)  # [H, RT] running sum of exp
        acc = torch.zeros(num_heads, ROW_TILE, head_dim, device=q.device)  # [H, RT, D]
        last = min(num_q, q0 + ROW_TILE) - 1 + num_ctx - num_q  # the tile's last real query position
        for s0 in range(0, last + 1, KV_TILE):
            scores = torch.bmm(q_tile, kf[:, s0 : s0 + KV_TILE].transpose(1, 2)) * scale  # [H, RT, KV_TILE]
            masked = (s0 + offsets)[None, :] > q_pos[:, None]  # [RT, KV_TILE] future (or padded) keys
            scores = scores.masked_fill(masked[None], float("-inf"))
            m_new = torch.maximum(m, scores.amax(dim=-1))  # [H, RT]
            # a padded query row sees position >= 0 only, so m_new is finite from tile 0 on
            alpha = torch.exp(m - m_new)  # [H, RT]
            p = torch.exp(scores - m_new[..., None])  # [H, RT, KV_TILE]
            denom = denom * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + torch.bmm(p, vf[:, s0 : s0 + KV_TILE])  # [H, RT, D]
            m = m_new
        out[:, q0 : q0 + ROW_TILE] = acc / denom[..., None]
    return out[:, :num_q].transpose(0, 1).to(q.dtype)  # [Q, H, D]


class BatchInvariantAttentionBackend(AttentionBackend):
    """A request's attention output independent of the batch, of its chunking and of prefix-cache hits.

    Where Triton runs (CUDA, or the interpreter): ops/invariant_attention.py for every step, decode
    included: the paged prefill kernel's walk over context tiles at fixed absolute positions, with one tile
    shape whatever the batch (the default kernels pick BLOCK_M by the longest chunk and the decode split
    count by the longest sequence), a GQA group per program so that decode reads each K/V tile once per
    kv head, and the context cut into partitions at fixed positions, so that a decode step of few rows
    splits over them and a recompute of the same token gets the same bits. It has no host sync, so decode
    steps still capture into CUDA graphs. Elsewhere: the torch
    paged backend's loop over requests (layers/attention.py) with invariant_attention."""

    # on CUDA only the Triton path runs, which reads device metadata of fixed capacity (worker/cuda_graph_runner.py)
    cuda_graph_safe = True

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # [NB, BS, KVH, D] each
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        if use_triton(q):
            return self._triton(q, k, v, kv_cache, attn_metadata, scale)
        return paged_attention_loop(q, k, v, kv_cache, attn_metadata, scale, invariant_attention)

    @staticmethod
    def _triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, scale: float) -> torch.Tensor:  # fmt: skip
        k_cache, v_cache = kv_cache
        assert meta.seq_lens_tensor is not None and meta.query_start_loc_tensor is not None  # __post_init__
        assert meta.max_query_len is not None
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        q = q if q.stride(2) == 1 else q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
        return packed_paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens_tensor,
                                      meta.query_start_loc_tensor, scale, out, max_query_len=meta.max_query_len,
                                      max_seq_len=meta.max_seq_len, block_n=TRITON_KV_TILE)  # fmt: skip


def make_batch_invariant(model: nn.Module) -> nn.Module:
    """Switch every GEMM and attention layer of a built model to its batch-invariant path; returns model.

    Layers opt in through a `batch_invariant` attribute (ShardedLinear, StackedExperts, SparseMoeBlock);
    plain nn.Linear modules (router gate, lm_head) become RowTiledLinear; attention layers get
    BatchInvariantAttentionBackend."""
    backend = BatchInvariantAttentionBackend()
    for module in model.modules():
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = True
        if type(module) is nn.Linear:
            module.__class__ = RowTiledLinear
        if isinstance(module, Attention):
            module.backend = backend
    return model
