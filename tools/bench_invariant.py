"""Deterministic mode's kernels against the default ones on one GPU, at Qwen3-30B-A3B shapes.

    python tools/bench_invariant.py [--rows 1,16,64,256,2048] [--batches 1,64,256] [--context 1024] [--out DIR]
        [--only matmul|attention]

Matmul: ops/invariant_matmul.py in candidate fixed configs (one config serves every M, so a config is
judged by its whole row of M) against cuBLAS, for the dense GEMMs of a layer (q/k/v 2048 -> 5120, o
4096 -> 2048, the router gate 2048 -> 128 in bf16 and, as GLM runs it, in float32) and lm_head (2048 ->
151936); each config's row 0 is checked to keep its bits across M. The summary prices a decode step's
dense GEMMs (48 layers of q/k/v + o + gate, one lm_head) per config at each batch; the prefill column
leaves lm_head out (it runs on the sampled rows only).
Attention: one decode step of B rows of `context` tokens (32:4 heads of 128, blocks of 16): the default
decode kernel (split-KV), the per-head prefill kernel deterministic mode ran before, and the GQA-packed
kernel (ops/invariant_attention.py) in a few tile shapes; and a 2048-token prefill.
Every time is a CUDA graph of 20 calls, divided by 20 (the engine replays decode steps as graphs).
Writes DIR/bench_invariant.png.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from bench_moe import graphed, time_fn

from fastdeploy_r3.model_executor.ops.invariant_attention import SPLIT_BELOW_PROGRAMS, packed_paged_attention
from fastdeploy_r3.model_executor.ops.invariant_matmul import CONFIG, MatmulConfig, invariant_matmul
from fastdeploy_r3.model_executor.ops.paged_decode import paged_decode_attention
from fastdeploy_r3.model_executor.ops.paged_prefill import paged_prefill_attention

LAYERS = 48
SHAPES = {"qkv": (5120, 2048, torch.bfloat16), "o": (2048, 4096, torch.bfloat16), "gate": (128, 2048, torch.bfloat16),
          "gate32": (128, 2048, torch.float32), "lm_head": (151936, 2048, torch.bfloat16)}  # fmt: skip
CANDIDATES: dict[str, MatmulConfig | None] = {
    "chosen (config_for)": None,  # what deterministic mode runs: one config per weight shape
    "64x64x64": CONFIG,
    "64x64x128": MatmulConfig(block_k=128),
    "64x32x128 s4": MatmulConfig(block_n=32, block_k=128, num_stages=4),
    "64x64x64 k2": MatmulConfig(split_k=2),
    "64x64x64 k4": MatmulConfig(split_k=4),
    "64x64x128 k4": MatmulConfig(block_k=128, split_k=4),
    "64x32x128 k4": MatmulConfig(block_n=32, block_k=128, split_k=4),
    "64x128x64 k4 w8": MatmulConfig(block_n=128, split_k=4, num_warps=8),
    "64x64x64 k8": MatmulConfig(split_k=8),
    "64x32x64 k8": MatmulConfig(block_n=32, split_k=8),
    "64x64x128 k2": MatmulConfig(block_k=128, split_k=2),
    "128x64x64 k4 w8": MatmulConfig(block_m=128, split_k=4, num_warps=8),
    "64x128x64 w8": MatmulConfig(block_n=128, num_warps=8),
    "128x128x64 w8": MatmulConfig(block_m=128, block_n=128, num_warps=8),
}


def graph_time(fn, inner: int = 20) -> float:  # noqa: ANN001
    """Median microseconds of one fn() call, from a CUDA graph of `inner` calls (tools/bench_moe.py's
    graphed and time_fn)."""
    return time_fn(graphed(lambda: [fn() for _ in range(inner)])) * 1e6 / inner


def bench_matmul(rows: list[int]) -> dict[str, dict[str, dict[int, float]]]:
    """{config name or 'cuBLAS': {shape: {M: us}}}, and prints whether each config keeps row 0's bits."""
    torch.manual_seed(0)
    got: dict[str, dict[str, dict[int, float]]] = {}
    for shape, (n, k, dtype) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
        x = torch.randn(max(rows), k, device="cuda", dtype=dtype)
        ms = [m for m in rows if shape != "lm_head" or m <= 256]  # logits: the sampled rows of a step only
        got.setdefault("cuBLAS", {})[shape] = {m: graph_time(lambda m=m, x=x, w=w: F.linear(x[:m], w)) for m in ms}
        for name, cfg in CANDIDATES.items():
            got.setdefault(name, {})[shape] = {
                m: graph_time(lambda m=m, c=cfg, x=x, w=w: invariant_matmul(x[:m], w, config=c)) for m in ms}
            first = [invariant_matmul(x[:m], w, config=cfg)[0] for m in ms]
            same = all(torch.equal(r, first[0]) for r in first)
            err = (invariant_matmul(x[:64], w, config=cfg).float() - F.linear(x[:64], w).float()).abs().max().item()
            print(f"{shape:8s} {name:20s} row 0 same bits at every M: {same}; max |err| vs cuBLAS {err:.2e}")
            if not same:
                raise SystemExit(f"{name} is not batch-invariant on {shape}")
    print(f"\n{'config':20s} " + " ".join(f"{s}@{m:<5d}" for s in SHAPES for m in rows))
    for name, by_shape in got.items():
        print(f"{name:20s} " + " ".join(f"{by_shape[s].get(m, float('nan')):>{len(s) + 6}.1f}"
                                        for s in SHAPES for m in rows))  # fmt: skip
    return got


def step_cost(t: dict[str, dict[int, float]], m: int) -> float:
    """Milliseconds of a decode step's dense GEMMs at m rows."""
    return (LAYERS * (t["qkv"][m] + t["o"][m] + t["gate"][m]) + t["lm_head"].get(m, 0.0)) / 1e3


def bench_attention(batches: list[int], context: int) -> dict[str, dict[int, float]]:
    heads, kv_heads, dim, bs = 32, 4, 128, 16
    # (block_n, num_warps, split): None = as deterministic mode runs it (split decode steps of few rows)
    packed = {"packed det": (64, 4, None), "packed one pass": (64, 4, False), "packed n128 one pass": (128, 4, False),
              "packed split n128": (128, 4, True)}  # fmt: skip
    got: dict[str, dict[int, float]] = {"default kernels": {}, "per-head (old det)": {}, **{n: {} for n in packed}}
    for b in [*batches, 0]:  # 0: one prefill of 2048 fresh tokens
        rows, q_len = (b, 1) if b else (1, 2048)
        seq = context if b else 2048
        blocks_per_row = -(-seq // bs)
        k_cache = torch.randn(rows * blocks_per_row, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(rows * blocks_per_row, device="cuda").view(rows, blocks_per_row)
        seq_lens = torch.full((rows,), seq, device="cuda", dtype=torch.int32)
        qsl = torch.arange(rows + 1, device="cuda", dtype=torch.int32) * q_len
        q = torch.randn(rows * q_len, heads, dim, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        args = (q, k_cache, v_cache, tables, seq_lens, qsl, dim**-0.5, out)
        key = b or "prefill 2048"
        if b:
            got["default kernels"][key] = graph_time(lambda a=args, s=seq: paged_decode_attention(*a, max_seq_len=s))
        else:
            got["default kernels"][key] = graph_time(lambda a=args: paged_prefill_attention(*a, max_query_len=2048))
        got["per-head (old det)"][key] = graph_time(
            lambda a=args, ql=q_len: paged_prefill_attention(*a, max_query_len=ql, block_m=16, block_n=64))
        for name, (bn, warps, split) in packed.items():
            if split and not b:
                got[name][key] = float("nan")  # a prefill is never split
                continue
            got[name][key] = graph_time(
                lambda a=args, ql=q_len, s=seq, bn=bn, w=warps, sp=split: packed_paged_attention(
                    *a, max_query_len=ql, max_seq_len=s, split=sp, block_n=bn, num_warps=w))  # fmt: skip
        ref = out.clone()
        paged_prefill_attention(*args, max_query_len=q_len, block_m=16, block_n=64)
        ref.copy_(out)
        packed_paged_attention(*args, max_query_len=q_len, max_seq_len=seq)
        print(f"attention {key}: packed vs per-head max |diff| {(out.float() - ref.float()).abs().max().item():.2e}")
        if b:
            ref.copy_(out)
            auto_split = b * kv_heads < SPLIT_BELOW_PROGRAMS
            packed_paged_attention(*args, max_query_len=1, max_seq_len=seq, split=not auto_split)
            print(f"attention {key}: split and one pass bit-equal: {torch.equal(out, ref)}")
    keys = [*batches, "prefill 2048"]
    print(f"\nattention us a layer (context {context})  " + " ".join(f"{str(k):>14s}" for k in keys))
    for name, t in got.items():
        print(f"{name:32s} " + " ".join(f"{t[k]:>14.1f}" for k in keys))
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,256,2048")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", choices=("matmul", "attention"), help="run one half")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    mm = bench_matmul(rows) if args.only != "attention" else {}
    print("\ndense GEMMs of a decode step, ms (48 layers of qkv + o + gate, one lm_head)")
    print(f"{'config':20s} " + " ".join(f"{'B=' + str(b):>10s}" for b in batches) + "   prefill M=" + str(max(rows)))
    for name, t in mm.items():
        print(f"{name:20s} " + " ".join(f"{step_cost(t, b):>10.3f}" for b in batches if b in rows)
              + f"   {step_cost(t, max(rows)):10.3f}")  # fmt: skip
    att = bench_attention(batches, args.context) if args.only != "matmul" else {}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, t in mm.items():
        ax1.plot(rows, [step_cost(t, m) for m in rows], marker="o", label=name, lw=2.5 if name == "cuBLAS" else 1)
    ax1.set(xscale="log", yscale="log", xlabel="rows (M)", ylabel="ms", title="dense GEMMs of one step")
    ax1.legend(fontsize=6)
    for i, (name, t) in enumerate(att.items()):
        width = 0.8 / len(att)
        ax2.bar([j + i * width for j in range(len(batches))], [t[b] for b in batches], width=width, label=name)
    ax2.set(xticks=range(len(batches)), xticklabels=[f"B={b}" for b in batches], ylabel="us a layer",
            title=f"decode attention, context {args.context}")  # fmt: skip
    ax2.legend(fontsize=7)
    os.makedirs(args.out, exist_ok=True)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "bench_invariant.png"), dpi=110)
    print(f"plot: {os.path.join(args.out, 'bench_invariant.png')}")


if __name__ == "__main__":
    main()
