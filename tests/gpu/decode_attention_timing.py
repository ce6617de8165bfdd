"""Decode attention on the GPU against its memory roofline (a script, not a test; pytest does not collect it).

    python tests/gpu/decode_attention_timing.py [--out table.md]

Qwen3-30B-A3B attention (32 q heads, 4 kv heads, head_dim 128, bf16, block 16), context 1024, batch
1 / 16 / 64 / 256. Like a real step, one CUDA graph holds the calls of 48 layers, each with its own KV
cache, so each layer's KV comes from HBM rather than L2. Reported per layer: the decode kernels alone
(+ split reduction), the backend (kv write + decode), the bytes a call must read (K and V of every
context token, q, out, block tables) over the measured copy bandwidth, and the torch backend's time.
Then the prefill kernel on 4 fresh 4096-token prompts, a few tilings, against torch's SDPA.
"""

from __future__ import annotations

import argparse
import time

import torch

from fastdeploy_r3.model_executor.forward_context import AttentionMetadata
from fastdeploy_r3.model_executor.layers.attention import TorchPagedAttentionBackend, TritonPagedAttentionBackend
from fastdeploy_r3.model_executor.ops.paged_decode import choose_num_splits, paged_decode_attention

H, KVH, D, BS, CTX, LAYERS = 32, 4, 128, 16, 1024, 48


def graph_time_us(fn, reps: int = 20) -> float:
    """Mean µs of one fn() call (fn runs once per layer inside), replayed from a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def copy_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy (read + write counted)."""
    a = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (time.perf_counter() - t)


def prefill_table(dev: torch.device, scale: float, batch: int = 4, prompt: int = 4096) -> list[str]:
    """Fresh prefill of `batch` prompts of `prompt` tokens: µs per layer for a few tilings, vs torch's SDPA."""
    import torch.nn.functional as F

    from fastdeploy_r3.model_executor.ops.paged_prefill import paged_prefill_attention

    blocks = prompt // BS
    k_cache = torch.randn(batch * blocks, BS, KVH, D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * blocks, device=dev).view(batch, blocks)
    meta = AttentionMetadata(torch.zeros(0, device=dev), [i * prompt for i in range(batch + 1)], [prompt] * batch,
                             [prompt] * batch, tables, BS)  # fmt: skip
    q = torch.randn(batch * prompt, H, D, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    flops = 4 * batch * (prompt * prompt / 2) * H * D  # causal QK^T and PV

    def timed(fn, reps: int = 5) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / reps

    rows = ["", f"prefill: {batch} prompts x {prompt} tokens, fresh (no prefix), one layer", "",
            "| kernel | µs per layer | TFLOP/s | tokens/s (attention alone, 48 layers) |", "|---|---|---|---|"]
    configs = {"triton 64x64 4 warps": (64, 64, 4), "triton 128x64 8 warps": (128, 64, 8),
               "triton 128x32 4 warps": (128, 32, 4)}  # fmt: skip
    for name, (bm, bn, warps) in configs.items():
        t = timed(lambda bm=bm, bn=bn, warps=warps: paged_prefill_attention(
            q, k_cache, v_cache, tables, meta.seq_lens_tensor, meta.query_start_loc_tensor, scale, out,
            max_query_len=prompt, block_m=bm, block_n=bn, num_warps=warps))  # fmt: skip
        rows.append(f"| {name} | {t:.0f} | {flops / t / 1e6:.0f} | {batch * prompt / (48 * t * 1e-6):,.0f} |")
        print(rows[-1], flush=True)
    qs = q.view(batch, prompt, H, D).transpose(1, 2)  # [B, H, S, D]
    ks = torch.randn(batch, KVH, prompt, D, device=dev, dtype=torch.bfloat16)
    t = timed(lambda: F.scaled_dot_product_attention(qs, ks, ks, is_causal=True, enable_gqa=True))
    rows.append(f"| torch SDPA (contiguous, no paging) | {t:.0f} | {flops / t / 1e6:.0f} | "
                f"{batch * prompt / (48 * t * 1e-6):,.0f} |")
    print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    lines = [f"copy bandwidth {bw / 1e12:.2f} TB/s; H={H} KVH={KVH} D={D} bf16 block {BS}, context {CTX}, "
             f"{LAYERS} layers per graph (µs are per layer)", "",
             "| batch | splits (auto) | decode kernels µs | best splits: µs | backend (write + decode) µs | "
             "bytes read | roofline µs | decode ÷ roofline | torch backend µs |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    dev = torch.device("cuda")
    scale = D**-0.5
    for batch in (1, 16, 64, 256):
        blocks_per_seq = CTX // BS
        num_blocks = batch * blocks_per_seq
        caches = [
            (torch.randn(num_blocks, BS, KVH, D, device=dev, dtype=torch.bfloat16),
             torch.randn(num_blocks, BS, KVH, D, device=dev, dtype=torch.bfloat16))
            for _ in range(LAYERS)
        ]  # fmt: skip
        tables = torch.randperm(num_blocks, device=dev).view(batch, blocks_per_seq)  # scattered blocks
        seq_lens = [CTX] * batch
        pos = torch.full((batch,), CTX - 1, device=dev)
        slots = tables[torch.arange(batch, device=dev), pos // BS] * BS + pos % BS
        meta = AttentionMetadata(slots, list(range(batch + 1)), [1] * batch, seq_lens, tables, BS)
        q = torch.randn(batch, H, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(batch, KVH, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        out = torch.empty_like(q)

        def decode(splits: int | None, block_n: int = 64, q=q, out=out, meta=meta, caches=caches) -> None:
            for kc, vc in caches:
                paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens_tensor, meta.query_start_loc_tensor,
                                       scale, out, max_seq_len=CTX, num_splits=splits, block_n=block_n)

        def backend_call(q=q, k=k, v=v, meta=meta, caches=caches) -> None:
            for kv in caches:
                TritonPagedAttentionBackend().forward(q, k, v, kv, meta, scale)

        auto = choose_num_splits(batch, KVH, CTX, dev)
        t_auto = graph_time_us(lambda: decode(None)) / LAYERS
        sweep = {s: graph_time_us(lambda s=s: decode(s)) / LAYERS for s in (1, 2, 4, 8, 16)}
        best = min(sweep, key=sweep.get)
        tiles = {n: graph_time_us(lambda n=n: decode(None, n)) / LAYERS for n in (32, 128)}
        print(f"batch {batch}: auto splits with BLOCK_N 32 / 64 / 128: {tiles[32]:.1f} / {t_auto:.1f} / "
              f"{tiles[128]:.1f} µs", flush=True)
        t_backend = graph_time_us(backend_call) / LAYERS
        kv_bytes = 2 * batch * CTX * KVH * D * 2
        other = 2 * batch * H * D * 2 + tables.numel() * 8 + batch * 8
        roof = (kv_bytes + other) / bw * 1e6
        t_torch = float("nan")
        if batch <= 16:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for kv in caches[:8]:
                TorchPagedAttentionBackend().forward(q, k, v, kv, meta, scale)
            torch.cuda.synchronize()
            t_torch = (time.perf_counter() - t0) * 1e6 / 8
        lines.append(f"| {batch} | {auto} | {t_auto:.1f} | {best}: {sweep[best]:.1f} | {t_backend:.1f} | "
                     f"{(kv_bytes + other) / 2**20:.1f} MiB | {roof:.1f} | {t_auto / roof:.2f} | {t_torch:.0f} |")
        print(lines[-1], flush=True)
        del caches
        torch.cuda.empty_cache()
    lines += prefill_table(dev, scale)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
