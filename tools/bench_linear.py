"""A decode step's dense linears at a few rows: cuBLAS (F.linear) against ops/skinny_linear.py.

    python tools/bench_linear.py [--preset qwen3-30b-a3b] [--rows 1,2,4,8,16] [--layers 48] [--png OUT.png]

For each dense weight shape of the preset (qkv, o, router gate, lm_head) and each row count, `--layers`
distinct weights of that shape (as many as the model has, so the L2 cache holds none of them between
uses) are applied one after the other inside one CUDA graph, the way a decode graph runs them; the graph
is replayed and timed with CUDA events. Prints µs per call, the bandwidth that implies (weight bytes /
time) against a copy's, and the largest difference between the two kernels' outputs (relative to the
output's largest magnitude). The skinny kernel serves rows <= MAX_ROWS only; larger counts time cuBLAS.
linear() serves the skinny kernel only weights of at most MAX_OUT_FEATURES outputs (the router gate):
the table is what that rule rests on.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from model_presets import preset_config  # noqa: E402

from fastdeploy_r3.model_executor.ops.skinny_linear import MAX_ROWS, skinny_linear  # noqa: E402


def shapes(preset: str) -> dict[str, tuple[int, int]]:
    """name -> (out_features, in_features) of the preset's dense linears."""
    c = preset_config(preset, num_layers=1)
    hidden, heads, kv_heads = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    out = {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim)}
    if c.get("num_experts") or c.get("n_routed_experts"):
        out["router"] = (c.get("num_experts") or c["n_routed_experts"], hidden)
    out["lm_head"] = (c["vocab_size"], hidden)
    return out


def time_graph(fn, repeats: int) -> float:  # noqa: ANN001
    """Seconds per replay of a CUDA graph of fn()."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile, warm the allocator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--png", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {args.layers} weights per shape, one CUDA graph per cell\n")
    print("| linear | out x in | rows | cuBLAS µs | skinny µs | cuBLAS TB/s | skinny TB/s | skinny / cuBLAS "
          "| max rel diff |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    results = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in shapes(args.preset).items():
        layers = 1 if name == "lm_head" else args.layers  # lm_head: 0.6 GB, far past the L2 on its own
        weights = [torch.randn(n, k, device="cuda", dtype=dtype, generator=g) * 0.02 for _ in range(layers)]
        nbytes = n * k * weights[0].element_size()
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=dtype, generator=g)
            t_cublas = time_graph(lambda x=x, ws=weights: [F.linear(x, w) for w in ws], args.repeats) / layers
            ref = F.linear(x, weights[0]).float()
            t_skinny = diff = float("nan")
            if rows <= MAX_ROWS:
                t_skinny = time_graph(lambda x=x, ws=weights: [skinny_linear(x, w) for w in ws], args.repeats) / layers
                diff = ((skinny_linear(x, weights[0]).float() - ref).abs().max() / ref.abs().max()).item()
            results.append((name, rows, t_cublas, t_skinny))
            print(f"| {name} | {n} x {k} | {rows} | {t_cublas * 1e6:.1f} | {t_skinny * 1e6:.1f} | "
                  f"{nbytes / t_cublas / 1e12:.2f} | {nbytes / t_skinny / 1e12:.2f} | {t_skinny / t_cublas:.2f} | "
                  f"{diff:.1e} |", flush=True)  # fmt: skip
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name in dict.fromkeys(r[0] for r in results):
            rs = [r for r in results if r[0] == name]
            ax.plot([r[1] for r in rs], [r[3] / r[2] for r in rs], marker="o", label=name)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows")
        ax.set_ylabel("skinny / cuBLAS time")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png)


if __name__ == "__main__":
    main()
