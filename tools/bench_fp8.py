"""FP8 weight kernels alone, over tile configs: which blocks the fp8 expert GEMMs and dense linears should pick.

    python tools/bench_fp8.py [--layers 48] [--batches 1,16,64,256] [--prefill-rows 2048,8192]
        [--only experts|dense] [--modes weight,w8a8,gemv] [--out DIR]

Qwen3-30B-A3B shapes, block-wise fp8 weights (quantization/fp8.py's served layout), a distinct weight set
per layer, all layers replayed from one CUDA graph (the decode path), so every weight crosses HBM:

- experts: the two expert GEMM launches of ops/fused_moe_triton.py (E=128, K=8, H=2048, I=768), ids drawn
  uniformly as dummy weights route, already aligned; against the bytes of the experts touched (one byte per
  weight plus scale rows) / the copy bandwidth, and against pick_config's bf16 kernel on bf16 weights;
- dense: ops/fp8_linear.py on qkv (2048 -> 5120) and o (4096 -> 2048) against cuBLAS on bf16 weights;
- gemv (one row only): ops/fp8_gemv.py's one-row W8A8 kernels over (BLOCK_N, BLOCK_K, num_warps).

A config that does not compile is reported and skipped. The tables print the fastest configs per batch,
with the share of copy bandwidth they reach; --out writes them as JSON and a plot (ms against rows per GEMM).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_moe import INTER, E, H, K, copy_bandwidth, graphed, time_fn

from fastdeploy_r3.model_executor.ops import fp8_linear as fp8_linear_op
from fastdeploy_r3.model_executor.ops.fp8_gemv import DOWN, GATED, fp8_gemv_experts, fp8_gemv_linear
from fastdeploy_r3.model_executor.ops.fused_moe_triton import (
    TritonMoeConfig,
    pick_config,
    pick_fp8_config,
    triton_experts,
)
from fastdeploy_r3.model_executor.ops.moe_align import align_to_blocks
from fastdeploy_r3.model_executor.quantization.fp8 import dequantize, expand_scale_rows, quantize_blockwise

DENSE_SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096)}  # (out, in)
WARPS_STAGES = ((2, 3), (4, 3), (4, 5), (2, 8), (4, 8), (8, 3))
MODES = ("weight", "w8a8", "gemv")
GEMV_GRID = [(bn, bk, w) for bn in (4, 8, 16) for bk in (512, 1024, 2048) for w in (4, 8)]


def quantized(out_features: int, in_features: int, experts: int | None, dev: torch.device,
              ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A random weight quantized block-wise: (fp8 [.., O, I], served scale rows [.., O, ceil(I/128)])."""
    n = experts or 1  # out_features is a multiple of 128 here: the stacked rows quantize as n separate weights
    codes, scale = quantize_blockwise(torch.randn(n * out_features, in_features, device=dev) * 0.02)
    rows = expand_scale_rows(scale, n * out_features)
    if experts is None:
        return codes, rows
    return codes.view(n, out_features, in_features), rows.view(n, out_features, -1)


def timed_configs(run, configs: list, label: str) -> list[tuple[float, object]]:  # noqa: ANN001
    """(ms, config) for every config run(config) compiles and replays from a graph."""
    out = []
    for cfg in configs:
        try:
            with torch.inference_mode():
                out.append((time_fn(graphed(lambda cfg=cfg: run(cfg)), reps=20) * 1e3, cfg))
        except Exception as exc:  # noqa: BLE001 (a config that does not compile is reported, not fatal)
            print(f"{label} {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    return out


def _per_mode(best: list, keep: int = 5) -> list:
    """The `keep` fastest (ms, (mode, config)) of each mode, fastest first within a mode."""
    return [t for mode in MODES for t in [t for t in best if t[1][0] == mode][:keep]]


def _cfg_json(cfg: object) -> object:
    return list(vars(cfg).values()) if isinstance(cfg, TritonMoeConfig) else str(cfg)


def expert_sweep(args: argparse.Namespace, dev: torch.device, bw: float) -> dict:
    torch.manual_seed(0)
    layers = [(quantized(2 * INTER, H, E, dev), quantized(H, INTER, E, dev)) for _ in range(args.layers)]
    bf16 = [(torch.randn(E, 2 * INTER, H, device=dev, dtype=torch.bfloat16) * 0.02,
             torch.randn(E, H, INTER, device=dev, dtype=torch.bfloat16) * 0.02) for _ in range(2)]  # fmt: skip
    per_expert = 3 * H * INTER + (2 * INTER * H // 128 + H * INTER // 128) * 4  # fp8 bytes + scale rows
    weight_only = [TritonMoeConfig(16, bn, bk, w, s) for bn in (16, 32, 64, 128) for bk in (64, 128)
                   for w, s in WARPS_STAGES]
    weight_only += [TritonMoeConfig(32, bn, bk, w, s) for bn in (64, 128) for bk in (64, 128)
                    for w, s in ((4, 3), (8, 3))]
    w8a8 = [TritonMoeConfig(bm, bn, 128, w, s) for bm in (16, 32, 64) for bn in (64, 128)
            for w, s in ((4, 3), (8, 3), (4, 4))]
    w8a8 += [TritonMoeConfig(16, bn, 128, w, s) for bn in (32, 64) for w, s in ((4, 5), (2, 8), (4, 8))]
    result = {}
    for bs in (int(b) for b in args.batches.split(",")):
        x = torch.randn(bs, H, device=dev, dtype=torch.bfloat16)
        ids = [torch.rand(bs, E, device=dev).argsort(dim=1)[:, :K] for _ in range(args.layers)]  # uniform, distinct
        weights = torch.full((bs, K), 1.0 / K, device=dev)
        touched = sum(int(torch.unique(i).numel()) for i in ids)
        roof_ms = touched * per_expert / bw * 1e3
        rows_per_expert = bs * K / E
        configs = [("w8a8", pick_fp8_config(bs, K, E))]
        configs += [("weight", c) for c in weight_only if (c.block_m == 16) == (rows_per_expert <= 8)]
        configs += [("w8a8", c) for c in w8a8 if c.block_m <= max(16, 2 * rows_per_expert)]
        if bs == 1:
            configs += [("gemv", {GATED: g, DOWN: d}) for g in GEMV_GRID for d in GEMV_GRID
                        if g in (d, (8, 1024, 4))]  # fmt: skip
        configs = configs[:1] + [c for c in configs[1:] if c[0] in args.modes]
        tile_configs = {c.block_m for m, c in configs if m != "gemv"}
        aligned = {bm: [align_to_blocks(i, E, bm) for i in ids] for bm in tile_configs}

        def run(mode_cfg: tuple, x: torch.Tensor = x, ids: list = ids, weights: torch.Tensor = weights,
                aligned: dict = aligned) -> None:  # fmt: skip
            mode, cfg = mode_cfg
            for layer, ((w13, s13), (w2, s2)) in enumerate(layers):
                if mode == "gemv":
                    fp8_gemv_experts(x, w13, s13, w2, s2, weights, ids[layer], cfg)
                    continue
                triton_experts(x, w13, w2, weights, ids[layer], cfg, aligned[cfg.block_m][layer], s13, s2,
                               fp8_activations=mode == "w8a8")  # fmt: skip

        # bf16 reference: pick_config on bf16 weights (two weight sets alternated: the bytes of 48 layers
        # would not fit beside the fp8 ones, so L2 could hold nothing across layers either way)
        def run_bf16(mode_cfg: tuple, x: torch.Tensor = x, ids: list = ids, weights: torch.Tensor = weights,
                     aligned: dict = aligned) -> None:  # fmt: skip
            for layer in range(args.layers):
                w13, w2 = bf16[layer % 2]
                triton_experts(x, w13, w2, weights, ids[layer], mode_cfg[1], aligned[mode_cfg[1].block_m][layer])

        bf16_ms = timed_configs(run_bf16, [("weight", pick_config(bs, K, E))], "bf16")[0][0]
        timed = timed_configs(run, configs, f"experts bs {bs}")
        auto_ms = timed[0][0]
        best = sorted(timed[1:], key=lambda t: t[0])
        print(f"\nexperts batch {bs}: {touched / args.layers:.1f} experts/layer, fp8 roofline {roof_ms:.3f} ms; "
              f"bf16 pick_config {bf16_ms:.3f} ms; fp8 pick_fp8_config {auto_ms:.3f} ms ({roof_ms / auto_ms:.0%})")
        for mode in MODES:
            for ms, (_, cfg) in [t for t in best if t[1][0] == mode][:5]:
                name = (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
                        if isinstance(cfg, TritonMoeConfig) else f"gate_up {cfg[GATED]} down {cfg[DOWN]}")
                print(f"  {mode} {name}: {ms:.3f} ms ({roof_ms / ms:.0%} of copy bandwidth; "
                      f"{ms / auto_ms:.2f}x pick_fp8_config)", flush=True)
        result[bs] = {"roofline_ms": roof_ms, "bf16_ms": bf16_ms, "fp8_pick_ms": auto_ms,
                      "best": [(ms, m, _cfg_json(c)) for ms, (m, c) in _per_mode(best)]}
    return result


def dense_sweep(args: argparse.Namespace, dev: torch.device, bw: float) -> dict:
    torch.manual_seed(0)
    result = {}
    grid = [("weight", (16, bn, bk, w, s)) for bn in (16, 32, 64) for bk in (64, 128) for w, s in WARPS_STAGES]
    grid += [("weight", (bm, bn, bk, w, s)) for bm in (32, 64) for bn in (64, 128) for bk in (64, 128)
             for w, s in ((4, 3), (8, 3))]
    grid += [("w8a8", (bm, bn, 128, w, s)) for bm in (16, 64, 128) for bn in (64, 128)
             for w, s in ((4, 3), (8, 3), (4, 4))]
    grid += [("w8a8", (16, bn, 128, w, s)) for bn in (16, 32) for w, s in WARPS_STAGES]
    for name, (out_f, in_f) in DENSE_SHAPES.items():
        weights = [quantized(out_f, in_f, None, dev) for _ in range(args.layers)]
        plain = [torch.randn(out_f, in_f, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(args.layers)]
        roof_ms = args.layers * (out_f * in_f + out_f * (in_f // 128) * 4) / bw * 1e3
        for rows in (int(b) for b in f"{args.batches},{args.prefill_rows}".split(",")):
            x = torch.randn(rows, in_f, device=dev, dtype=torch.bfloat16)
            cublas = timed_configs(lambda _c, x=x, plain=plain: [torch.nn.functional.linear(x, w) for w in plain],
                                   [None], "cublas")
            dequant = timed_configs(lambda _c, x=x, weights=weights: [
                torch.nn.functional.linear(x, dequantize(w, s, torch.bfloat16)) for w, s in weights], [None], "dequant")
            picked = ("w8a8", fp8_linear_op._tiles(rows, out_f, True))

            def run(mode_tiles: tuple, x: torch.Tensor = x, weights: list = weights) -> None:
                for w, s in weights:
                    if mode_tiles[0] == "gemv":
                        fp8_gemv_linear(x, w, s, mode_tiles[1])
                        continue
                    fp8_linear_op.fp8_linear(x, w, s, tiles=mode_tiles[1], fp8_activations=mode_tiles[0] == "w8a8")

            small = rows <= 16
            configs = [picked, *[g for g in grid if (g[1][0] == 16) == small or g[0] == "w8a8"]]
            if rows > 1024:  # prefill rows: only the tall tiles
                configs = [picked, *[g for g in grid if g[1][0] >= 64]]
            if rows == 1:
                configs += [("gemv", t) for t in GEMV_GRID]
            configs = configs[:1] + [c for c in configs[1:] if c[0] in args.modes]
            timed = timed_configs(run, configs, f"dense {name} {rows}")
            best = sorted(timed[1:], key=lambda t: t[0])
            print(f"\ndense {name} rows {rows}: fp8 roofline {roof_ms:.3f} ms, cuBLAS bf16 {cublas[0][0]:.3f} ms, "
                  f"dequantise + cuBLAS {dequant[0][0]:.3f} ms, fp8 _tiles (W8A8) {picked[1]} {timed[0][0]:.3f} ms "
                  f"({roof_ms / timed[0][0]:.0%})")
            for mode in MODES:
                for ms, (_, cfg) in [t for t in best if t[1][0] == mode][:4]:
                    print(f"  {mode} {cfg}: {ms:.3f} ms ({roof_ms / ms:.0%}; {ms / timed[0][0]:.2f}x _tiles)",
                          flush=True)
            result[f"{name}/{rows}"] = {
                "roofline_ms": roof_ms, "cublas_ms": cublas[0][0], "dequant_ms": dequant[0][0],
                "fp8_tiles_ms": timed[0][0], "best": [(ms, m, list(c)) for ms, (m, c) in _per_mode(best)],
            }
        weights = plain = None  # freed before the next shape's weights
        torch.cuda.empty_cache()
    return result


def plot(res: dict, path: str) -> None:
    """Per GEMM, ms for 48 layers against rows: cuBLAS bf16 (bf16 experts), the best weight-only and W8A8
    configs of the sweep, and the fp8 roofline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {"experts": res.get("experts", {})}
    for key, row in res.get("dense", {}).items():
        name, rows = key.split("/")
        panels.setdefault(name, {})[rows] = row
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], panels.items(), strict=True):
        xs = sorted(rows, key=int)
        series = {"bf16 (cuBLAS / Triton)": [rows[x].get("cublas_ms", rows[x].get("bf16_ms")) for x in xs],
                  "fp8 roofline": [rows[x]["roofline_ms"] for x in xs]}
        for mode in MODES:
            series[f"fp8 {mode}, best"] = [min((b[0] for b in rows[x]["best"] if b[1] == mode), default=None)
                                           for x in xs]  # fmt: skip
        for label, ys in series.items():
            pts = [(int(x), y) for x, y in zip(xs, ys, strict=True) if y is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-" if "roofline" not in label else "s--", label=label)
        ax.set(xscale="log", yscale="log", xlabel="rows (tokens)", ylabel="ms, 48 layers", title=name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--prefill-rows", default="2048,8192", help="dense only: rows of prefill chunks")
    ap.add_argument("--only", choices=("experts", "dense"), default=None)
    ap.add_argument("--modes", default="weight,w8a8,gemv",
                    help="which kernels to sweep: weight (-only), w8a8, gemv (one row)")
    ap.add_argument("--out", default=None, help="directory for bench_fp8.json and bench_fp8.png")
    args = ap.parse_args()
    args.modes = args.modes.split(",")
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    res = {"copy_bandwidth": bw}
    if args.only in (None, "dense"):
        res["dense"] = dense_sweep(args, dev, bw)
    if args.only in (None, "experts"):
        res["experts"] = expert_sweep(args, dev, bw)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_fp8.json"), "w") as f:
            json.dump(res, f, indent=1)
        plot(res, os.path.join(args.out, "bench_fp8.png"))


if __name__ == "__main__":
    main()
