"""Expert-parallel MoE layer, per rank: dispatch / experts / combine / reduce time and the bytes each rank
sends, for the two dispatches (layers/expert_dispatch.py's local one, layers/expert_alltoall.py's
all-to-all), over a range of step sizes.

    python tools/bench_ep.py --device cpu --ep 2                      # gloo, a small MoE shape
    python tools/bench_ep.py --device cuda --ep 8 --preset glm-4.5    # NCCL, one GPU per rank

N processes (one per rank, NCCL on CUDA, gloo on the CPU) each build one MoE layer of the preset's shape
(--preset, tools/model_presets.py; else --hidden/--experts/--top-k/--inter) holding its contiguous E/N
experts, and run it on --tokens random hidden states (the same on every rank, as under TP attention):

    local      every rank runs the rows of its own experts; the layer all-reduces [T, H] (with the shared
               experts' partial sum): a ring sends 2 (N-1)/N x T x H x bytes per rank
    alltoall   rank r sends the rows of its T/N tokens to their experts' ranks, gets the results back,
               sums over k, all-gathers [T, H] (AllToAllDispatch.bytes_sent counts what leaves a rank);
               shared experts, if any, all-reduced on their own

Roofline (per rank, per layer): the bytes the rank must move at least, over the device's copy bandwidth
(measured as tools/bench_r3.py measures it, or --bandwidth-gbs): the weights of its experts that got at
least one row (w13 + w2 of each; an expert no token chose is not read), its share of the shared experts'
weights, and the bytes its dispatch sends (bytes_sent below). "layer / roofline" is how far the measured
layer is from that floor.

Times are medians over --repeats after --warmup, each stage closed by a device sync (so a stage's time
includes waiting for the slowest rank in its collective). "step" is the layer time times the preset's MoE
layer count: the MoE share of one forward step at that batch, attention and dense layers not included.
Prints a table per rank and writes --png (time and bytes vs tokens, max over ranks) and --json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TOOLS_DIR))
sys.path.insert(0, TOOLS_DIR)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

BACKENDS = ("local", "alltoall")
STAGES = ("dispatch", "experts", "combine", "reduce")


def moe_shape(args: argparse.Namespace) -> dict[str, int]:
    """hidden, experts, top_k, inter, shared (shared experts' intermediate size), moe_layers."""
    if args.preset is None:
        return {"hidden": args.hidden, "experts": args.experts, "top_k": args.top_k, "inter": args.inter,
                "shared": 0, "moe_layers": 1}
    from model_presets import preset_config

    from fastdeploy_r3.config.hf_config import normalize_hf_config, num_routed_experts_from_hf_config

    hf = preset_config(args.preset)
    norm = normalize_hf_config(hf)
    inter = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
    dense = int(hf.get("first_k_dense_replace") or 0) + len(hf.get("mlp_only_layers") or [])
    return {"hidden": int(hf["hidden_size"]), "experts": num_routed_experts_from_hf_config(hf),
            "top_k": int(hf["num_experts_per_tok"]), "inter": inter,
            "shared": inter * int(norm.get("n_shared_experts") or 0),
            "moe_layers": int(hf["num_hidden_layers"]) - dense}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_layer(block: Any, x: torch.Tensor, device: torch.device) -> tuple[dict[str, float], torch.Tensor]:
    """One forward of `block` (a SparseMoeBlock), stage by stage as SparseMoeBlock.forward runs them."""
    from fastdeploy_r3.distributed.parallel_state import all_reduce

    experts, t = block.experts, {}
    weights, ids = block.route(x)
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    rows = experts.dispatch.dispatch(x, weights, ids)
    _sync(device)
    t1 = time.perf_counter()
    if rows.x.shape[0]:
        y = experts.quant_method.apply(experts, rows.x, rows.topk_weights, rows.slots, None)
    else:
        y = x.new_zeros(0, x.shape[1])
    _sync(device)
    t2 = time.perf_counter()
    out = experts.dispatch.combine(y, rows)
    _sync(device)
    t3 = time.perf_counter()
    shared = None if block.shared_experts is None else block.shared_experts(x)
    if experts.dispatch.complete:
        out = out if shared is None else out + all_reduce(shared)
    else:
        out = all_reduce(out if shared is None else out + shared)
    _sync(device)
    t4 = time.perf_counter()
    t.update(dispatch=t1 - t0, experts=t2 - t1, combine=t3 - t2, reduce=t4 - t3)
    return t, out


def roofline_bytes(block: Any, ids: torch.Tensor, shape: dict[str, int], elem: int, sent: int) -> dict[str, int]:
    """What one rank must read for one layer: its touched experts' weights, its shared-expert shard, and
    the dispatch bytes it sends. ids [T, K] logical (the same on every rank)."""
    placement = block.experts.placement
    touched = sum(1 for e in torch.unique(ids).tolist() if placement.local_slots(e))
    expert_bytes = 3 * shape["inter"] * shape["hidden"] * elem  # w13 [2I, H] + w2 [H, I]
    shared_bytes = 3 * shape["shared"] * shape["hidden"] * elem // placement.ep_size
    return {"touched_experts": touched, "weight_bytes": touched * expert_bytes + shared_bytes,
            "roofline_bytes": touched * expert_bytes + shared_bytes + sent}


def rank_main(rank: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    from fastdeploy_r3.model_executor.layers.expert_alltoall import TorchGroup, use_moe_a2a_backend
    from fastdeploy_r3.model_executor.layers.expert_placement import ExpertPlacement
    from fastdeploy_r3.model_executor.layers.moe import SparseMoeBlock

    n, cuda = args.ep, args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)
    shape, dtype = moe_shape(args), getattr(torch, args.dtype)
    torch.manual_seed(0)  # the same router and shared experts on every rank (they are replicated / split alike)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        block = SparseMoeBlock(shape["hidden"], shape["experts"], shape["top_k"], shape["inter"], moe_index=0,
                               shared_intermediate_size=shape["shared"], tp_rank=rank, tp_size=n,
                               placement=ExpertPlacement.contiguous(shape["experts"], n, rank))
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
    elem = torch.tensor([], dtype=dtype).element_size()
    if args.bandwidth_gbs:
        bandwidth = args.bandwidth_gbs * 1e9
    else:
        from bench_r3 import copy_bandwidth

        bandwidth = copy_bandwidth(args.device)  # bytes read + written per second, this rank's device
    rows: list[dict[str, Any]] = []
    for tokens in args.tokens:
        x = torch.randn(tokens, shape["hidden"], generator=torch.Generator().manual_seed(tokens)).to(device, dtype)
        outs = {}
        for backend in BACKENDS:
            use_moe_a2a_backend(block, backend, TorchGroup() if backend == "alltoall" else None)
            samples: list[dict[str, float]] = []
            with torch.no_grad():
                for i in range(args.warmup + args.repeats):
                    if i == args.warmup and backend == "alltoall":
                        sent_before = block.experts.dispatch.bytes_sent.total
                    stages, outs[backend] = time_layer(block, x, device)
                    if i >= args.warmup:
                        samples.append(stages)
            ring = 2 * (n - 1) * tokens * shape["hidden"] * elem // n  # one all-reduce of [T, H], per rank
            if backend == "local":
                sent = ring
            else:
                sent = (block.experts.dispatch.bytes_sent.total - sent_before) // args.repeats
                sent += ring if shape["shared"] else 0
            med = {s: statistics.median(d[s] for d in samples) * 1e3 for s in STAGES}
            layer = sum(med.values())
            with torch.no_grad():
                roof = roofline_bytes(block, block.route(x)[1], shape, elem, sent)
            roofline_ms = roof["roofline_bytes"] / bandwidth * 1e3
            rows.append({"rank": rank, "backend": backend, "tokens": tokens, **{f"{s}_ms": med[s] for s in STAGES},
                         "layer_ms": layer, "step_ms": layer * shape["moe_layers"], "bytes_sent": sent, **roof,
                         "bandwidth": bandwidth, "roofline_ms": roofline_ms,
                         "layer_over_roofline": layer / roofline_ms})
        a, b = outs["local"].float(), outs["alltoall"].float()
        diff = ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()
        for r in rows[-2:]:
            r["max_rel_diff"] = diff  # the two dispatches compute the same layer (sums in another order)
    gathered: list[Any] = [None] * n
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"shape": shape, "ep": n, "device": args.device, "dtype": args.dtype,
                       "rows": [r for part in gathered for r in part]}, f)
    dist.barrier()
    dist.destroy_process_group()


def print_table(res: dict) -> None:
    s = res["shape"]
    print(f"EP={res['ep']} {res['device']} {res['dtype']}: hidden {s['hidden']}, {s['experts']} experts "
          f"top-{s['top_k']}, expert intermediate {s['inter']}, shared {s['shared']}, {s['moe_layers']} MoE layers")
    print("| backend | tokens | rank | dispatch ms | experts ms | combine ms | reduce ms | layer ms | step ms "
          "| bytes sent / layer | roofline ms | layer / roofline | max diff / max out |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(res["rows"], key=lambda r: (r["backend"], r["tokens"], r["rank"])):
        print(f"| {r['backend']} | {r['tokens']} | {r['rank']} | {r['dispatch_ms']:.3f} | {r['experts_ms']:.3f} "
              f"| {r['combine_ms']:.3f} | {r['reduce_ms']:.3f} | {r['layer_ms']:.3f} | {r['step_ms']:.2f} "
              f"| {r['bytes_sent']} | {r['roofline_ms']:.4f} | {r['layer_over_roofline']:.1f} "
              f"| {r['max_rel_diff']:.2e} |")


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    tokens = sorted({r["tokens"] for r in res["rows"]})
    for color, backend in zip(("C0", "C1"), BACKENDS, strict=True):
        mine = [r for r in res["rows"] if r["backend"] == backend]
        ax1.plot(tokens, [max(r["roofline_ms"] for r in mine if r["tokens"] == t) for t in tokens], "s-.",
                 color=color, label=f"{backend} roofline")
        for stage, style in (("layer", "-o"), ("dispatch", ":"), ("combine", "--")):
            ax1.plot(tokens, [max(r[f"{stage}_ms"] for r in mine if r["tokens"] == t) for t in tokens], style,
                     color=color, label=f"{backend} {stage}")
        ax2.plot(tokens, [max(r["bytes_sent"] for r in mine if r["tokens"] == t) for t in tokens], "-o",
                 color=color, label=backend)
    ax1.set(xscale="log", yscale="log", xlabel="tokens per step", ylabel="ms (max over ranks)",
            title="MoE layer time per rank")
    ax2.set(xscale="log", yscale="log", xlabel="tokens per step", ylabel="bytes", title="bytes sent per rank per layer")
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
    fig.suptitle(f"EP={res['ep']} {res['device']} {res['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--ep", type=int, default=2, help="ranks (processes; on CUDA one GPU each)")
    ap.add_argument("--preset", default=None, help="MoE shape of a tools/model_presets.py preset")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bandwidth-gbs", type=float, default=None,
                    help="the device's bandwidth for the roofline, GB/s (default: a copy measured on each rank)")
    ap.add_argument("--png", default="bench_ep.png")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cuda" and torch.cuda.device_count() < args.ep:
        raise SystemExit(f"--ep {args.ep} needs {args.ep} GPUs, {torch.cuda.device_count()} visible")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = args.json or os.path.join(os.path.dirname(os.path.abspath(args.png)), "bench_ep.json")
    torch.multiprocessing.spawn(rank_main, args=(args, port, out_path), nprocs=args.ep, join=True)
    with open(out_path) as f:
        res = json.load(f)
    print_table(res)
    plot(res, args.png)
    print(f"wrote {args.png} and {out_path}")


if __name__ == "__main__":
    main()
