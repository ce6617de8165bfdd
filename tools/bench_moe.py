"""The routed experts alone, per batch size: Triton kernels vs torch._grouped_mm vs the expert roofline.

    python tools/bench_moe.py [--layers 48] [--batches 1,16,64,256] [--dtype bfloat16] [--out DIR]
    python tools/bench_moe.py --routing [--router softmax|sigmoid] [--batches 1,16,64,256,4096]
    python tools/bench_moe.py --expert-sweep [--batches 1,4,16]

--expert-sweep times the two expert GEMM launches alone (ids drawn uniformly, as dummy weights route,
already aligned), all layers in one CUDA graph, for a grid of block configs, against the bytes of the
experts touched: which config pick_config should give decode and verify batches.

--routing times the routing alone instead (router logits -> ids, weights, R3 capture write, alignment),
per MoE layer: the unfused sequence the layers ran before ops/fused_routing.py (softmax, torch.topk,
renormalise, the capture kernel, align_to_blocks: ~6 launches) against the fused kernel, as picked
(auto) and forced to one launch / two launches (which says where ONE_LAUNCH_MAX_TOKENS belongs).

Qwen3-30B-A3B expert shape (E=128, K=8, H=2048, I=768), one weight set per layer, softmax top-8 routing
on random hidden states. Per batch size and backend: all layers eager, and all layers replayed from one
CUDA graph (the decode path), against the roofline = experts touched (counted from the routing, per
layer) x bytes per expert / copy bandwidth (measured here). Triton is also timed for each block config
of a small sweep. The tables say which backend fused_moe.choose_backend should pick (graphed and eager).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastdeploy_r3.model_executor.layers.fused_moe import grouped_mm_experts
from fastdeploy_r3.model_executor.layers.moe import softmax_topk
from fastdeploy_r3.model_executor.ops.fused_moe_triton import TritonMoeConfig, pick_config, triton_experts
from fastdeploy_r3.model_executor.ops.fused_routing import RouterSpec, fused_routing
from fastdeploy_r3.model_executor.ops.moe_align import align_to_blocks
from fastdeploy_r3.model_executor.ops.routing_capture_kernel import capture_topk_ids

E, K, H, INTER = 128, 8, 2048, 768
SWEEP = [
    TritonMoeConfig(16, 64, 128, 4, 3),
    TritonMoeConfig(16, 128, 128, 4, 3),
    TritonMoeConfig(16, 32, 256, 4, 4),
    TritonMoeConfig(32, 64, 64, 4, 3),
    TritonMoeConfig(64, 128, 64, 8, 3),
]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy (median of 10)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * a.numel() / sorted(times[3:])[len(times[3:]) // 2]


def time_fn(fn, reps: int = 10) -> float:  # noqa: ANN001
    """Median seconds of fn() over reps runs (events, after two warm-ups)."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[reps // 2]


def graphed(fn):  # noqa: ANN001, ANN201
    """fn recorded once into a CUDA graph; returns a replay callable."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def unfused_routing(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None, buffer: torch.Tensor,
                    moe_index: int, block_m: int) -> None:  # fmt: skip
    """The sequence a MoE layer ran before the fused kernel (torch.topk, as it was: no stated tie rule)."""
    if spec.scoring == "softmax":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = torch.topk(probs, spec.top_k, dim=-1)  # [T, K]
    else:
        scores = logits.float().sigmoid()  # [T, E] (one group: no group mask, as GLM-4.5-Air)
        ids = (scores + bias).topk(spec.top_k, dim=-1)[1]  # [T, K]
        weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    capture_topk_ids(buffer, moe_index, ids)
    align_to_blocks(ids, logits.shape[1], block_m)


def bench_routing(args: argparse.Namespace, dev: torch.device, dtype: torch.dtype) -> None:
    """Per MoE layer (all layers in one CUDA graph, as a decode step replays them): unfused vs fused."""
    if args.router == "softmax":
        spec, bias = RouterSpec(K, "softmax", renormalize=True), None  # Qwen3-30B-A3B
    else:
        spec, bias = RouterSpec(K, "sigmoid", True), torch.randn(E, device=dev) * 0.1  # GLM-4.5-Air
    print(f"\nrouting, {args.router}, E={E} K={K}, {args.layers} layers, {args.dtype} logits: us per layer")
    print("| batch | unfused | fused (auto) | fused one launch | fused two launches | unfused / auto |")
    print("| ----- | ------- | ------------ | ---------------- | ------------------ | -------------- |")
    for bs in (int(b) for b in args.batches.split(",")):
        us = routing_times(bs, spec, bias, args.layers, dev, dtype)
        print(f"| {bs:5d} | {us['unfused']:7.1f} | {us['auto']:12.1f} | {us['one']:16.1f} | {us['two']:18.1f} | "
              f"{us['unfused'] / us['auto']:14.2f} |", flush=True)


def routing_times(bs: int, spec: RouterSpec, bias: torch.Tensor | None, num_layers: int, dev: torch.device,
                  dtype: torch.dtype) -> dict[str, float]:  # fmt: skip
    """Microseconds per layer of each routing variant at batch bs, all layers replayed from one graph."""
    logits = [torch.randn(bs, E, device=dev).to(dtype) for _ in range(num_layers)]  # [T, E] per layer
    buffer = torch.zeros(bs, num_layers, K, dtype=torch.int32, device=dev)  # the R3 step buffer
    slots = torch.arange(bs, device=dev)
    block_m = pick_config(bs, K, E).block_m
    variants = {
        "unfused": lambda i: unfused_routing(logits[i], spec, bias, buffer, i, block_m),
        "auto": lambda i: fused_routing(logits[i], spec, bias, buffer, i, slots, block_m),
        "one": lambda i: fused_routing(logits[i], spec, bias, buffer, i, slots, block_m, one_launch=True),
        "two": lambda i: fused_routing(logits[i], spec, bias, buffer, i, slots, block_m, one_launch=False),
    }
    us = {}
    for name, route in variants.items():
        with torch.inference_mode():
            replay = graphed(lambda route=route: [route(i) for i in range(num_layers)])
            us[name] = time_fn(replay, reps=20) / num_layers * 1e6
    return us


def expert_sweep(args: argparse.Namespace, dev: torch.device, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    bw = copy_bandwidth(dev)
    w13 = [(torch.randn(E, 2 * INTER, H, device=dev) * 0.02).to(dtype) for _ in range(args.layers)]
    w2 = [(torch.randn(E, H, INTER, device=dev) * 0.02).to(dtype) for _ in range(args.layers)]
    per_expert = 3 * H * INTER * w13[0].element_size()
    grid = [TritonMoeConfig(16, bn, bk, w, s) for bn in (32, 64, 128) for bk in (64, 128, 256)
            for w, s in ((4, 3), (4, 4), (4, 5), (2, 4), (8, 4)) if bn * bk <= 16384]
    grid += [TritonMoeConfig(16, 16, bk, w, 4) for bk in (128, 256) for w in (2, 4)]
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {len(grid)} configs", flush=True)
    for bs in (int(b) for b in args.batches.split(",")):
        x = torch.randn(bs, H, device=dev, dtype=dtype)
        ids = [torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(bs)]) for _ in range(args.layers)]
        weights = torch.full((bs, K), 1.0 / K, device=dev)
        touched = sum(int(torch.unique(i).numel()) for i in ids)
        roof = touched * per_expert / bw
        timed = []
        for cfg in [pick_config(bs, K, E), *grid]:
            blocks = [align_to_blocks(i, E, cfg.block_m) for i in ids]

            def run(cfg: TritonMoeConfig = cfg, blocks: list = blocks, x: torch.Tensor = x,
                    ids: list = ids, weights: torch.Tensor = weights) -> None:
                for layer in range(args.layers):
                    triton_experts(x, w13[layer], w2[layer], weights, ids[layer], cfg, blocks[layer])

            try:
                with torch.inference_mode():
                    ms = time_fn(graphed(run), reps=20) * 1e3
            except Exception as exc:  # noqa: BLE001 (a config that does not compile is reported, not fatal)
                print(f"bs {bs} {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            timed.append((ms, cfg))
        auto_ms = timed[0][0]
        print(f"\nbatch {bs}: {touched / args.layers:.1f} experts/layer, roofline {roof * 1e3:.3f} ms, "
              f"pick_config {timed[0][1]} {auto_ms:.3f} ms ({roof * 1e3 / auto_ms:.0%} of copy bandwidth)")
        for ms, cfg in sorted(timed[1:], key=lambda t: t[0])[:8]:
            print(f"  {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}: {ms:.3f} ms "
                  f"({roof * 1e3 / ms:.0%}; {ms / auto_ms:.2f}x pick_config)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--out", default=None, help="directory for moe_bench.json")
    ap.add_argument("--routing", action="store_true", help="time the routing (unfused vs fused) instead")
    ap.add_argument("--router", default="softmax", choices=("softmax", "sigmoid"))
    ap.add_argument("--expert-sweep", action="store_true", help="time the expert GEMMs alone over block configs")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.expert_sweep:
        expert_sweep(args, dev, getattr(torch, args.dtype))
        return
    if args.routing:
        bench_routing(args, dev, getattr(torch, args.dtype))
        return
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    bw = copy_bandwidth(dev)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    layers = [
        (
            (torch.randn(H, E, device=dev) * 0.02).to(dtype),  # router [H, E]
            (torch.randn(E, 2 * INTER, H, device=dev) * 0.02).to(dtype),  # w13 [E, 2I, H]
            (torch.randn(E, H, INTER, device=dev) * 0.02).to(dtype),  # w2 [E, H, I]
        )
        for _ in range(args.layers)
    ]
    per_expert = 3 * H * INTER * torch.tensor([], dtype=dtype).element_size()

    def moe_all(x: torch.Tensor, experts) -> torch.Tensor:  # noqa: ANN001
        for router, w13, w2 in layers:
            weights, ids = softmax_topk(x @ router, K, True)  # [T, K], [T, K]
            x = x + experts(x, w13, w2, weights, ids)
        return x

    results = []
    for bs in (int(b) for b in args.batches.split(",")):
        x = torch.randn(bs, H, device=dev, dtype=dtype)
        touched = 0
        with torch.inference_mode():
            h = x
            for router, w13, w2 in layers:
                _, ids = softmax_topk(h @ router, K, True)
                touched += int(torch.unique(ids).numel())
                h = h + triton_experts(h, w13, w2, torch.full(ids.shape, 1.0 / K, device=dev), ids)
        roof = touched * per_expert / bw
        row = {"batch": bs, "experts_touched_per_layer": touched / args.layers, "roofline_ms": roof * 1e3}
        candidates = {"triton[auto]": lambda a, b, c, d, e, bs=bs: triton_experts(a, b, c, d, e, pick_config(bs, K, E))}
        for cfg in SWEEP:
            name = f"triton[{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}]"
            candidates[name] = lambda a, b, c, d, e, cfg=cfg: triton_experts(a, b, c, d, e, cfg)
        if dtype == torch.bfloat16:
            candidates["grouped_mm"] = grouped_mm_experts
        for name, experts in candidates.items():
            try:
                with torch.inference_mode():
                    eager = time_fn(lambda experts=experts, x=x: moe_all(x, experts), reps=5)
                    replay = graphed(lambda experts=experts, x=x: moe_all(x, experts))
                    graph_s = time_fn(replay, reps=20)
            except Exception as exc:  # noqa: BLE001 (a config that does not compile is reported, not fatal)
                print(f"bs {bs:4d} {name:34s} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            row[name] = {"eager_ms": eager * 1e3, "graph_ms": graph_s * 1e3}
            print(f"bs {bs:4d} {name:34s} eager {eager * 1e3:8.2f} ms  graph {graph_s * 1e3:8.2f} ms  "
                  f"roofline {roof * 1e3:6.2f} ms  graph/roof {graph_s / roof:5.2f}", flush=True)
        results.append(row)
    for mode in ("graph_ms", "eager_ms"):
        print(f"\n{mode}: | batch | experts/layer | roofline ms | triton[auto] | best triton | grouped_mm |")
        print("| ----- | ------------- | ----------- | ------------ | ----------- | ---------- |")
        for row in results:
            tri = [v[mode] for k, v in row.items() if k.startswith("triton[") and isinstance(v, dict)]
            gmm = row.get("grouped_mm", {}).get(mode, float("nan"))
            auto = row.get("triton[auto]", {}).get(mode, float("nan"))
            print(f"| {row['batch']:5d} | {row['experts_touched_per_layer']:13.1f} | {row['roofline_ms']:11.2f} | "
                  f"{auto:12.2f} | {min(tri, default=float('nan')):11.2f} | {gmm:10.2f} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "moe_bench.json"), "w") as f:
            json.dump({"copy_bandwidth": bw, "layers": args.layers, "dtype": args.dtype, "time": time.time(),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
