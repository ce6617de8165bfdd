"""The engine benchmark: decode step time against the memory roofline, tokens/s, prefill tokens/s and the
cost of R3, per batch size; and (--mode cost) the older end-to-end R3 on/off throughput and gather cost.

    python tools/bench_r3.py --preset qwen3-30b-a3b --device cuda [--layers 48] [--batches 1,16,64,256]
        [--prompt-len 1024] [--decode-steps 16] [--prefill-prompts 8 --prefill-len 4096]
        [--png bench.png] [--profile-batch 16] [--out DIR] [--hf] [--quantization fp8]
        [--enable-deterministic-inference]
    python tools/bench_r3.py --device cpu            # the fake tiny qwen3_moe: what CI keeps alive
    python tools/bench_r3.py --mode cost [--rounds 3] [--prompts 8] [--prompt-len 64] [--max-tokens 32]

Engine mode drives one ModelRunner in-process (tools/step_bench.py): dummy weights of the preset drawn on
the device (or the fake checkpoint), per batch size B: B random prompts (groups of 4 share their first
half), prefill, then decode steps alternating R3 on / off (a paired A/B in one run). Per batch it prints
the median decode step (R3 on), the memory roofline = bytes the step must read (experts touched, counted
from its R3 rows; other weights; embedding rows; KV) / the copy bandwidth measured here, their ratio,
output tokens/s = B / step, the R3 on/off step ratio, and the host time spent preparing inputs. That
synchronous "step ms" runs each step whole (launch, then wait for its sampled ids) with every request sent
in full: it includes the host input preparation and the sampled-id wait, which the server hides. "pipelined
step ms" (R3 on) is the step as the server's worker runs it (worker_process.py StepPipeline): the next step
launched before the previous one finishes, running requests sent as diffs (no new blocks) with placeholder
tokens the runner fills on the device from the previous step's draw; median time between finishes. Prefill
tokens/s is timed on --prefill-prompts prompts of --prefill-len tokens. --png plots step vs roofline and
the R3 ratio by batch; --profile-batch writes a torch.profiler table of 3 decode steps; --hf times HF
transformers' decode step on the same shape afterwards. --quantization fp8 quantizes the weights at load
(one byte per expert and linear weight, plus their float32 scale rows): the roofline counts those bytes.

Cost mode (CPU, fake `small` model): one engine with R3 on and one with it off, rounds alternating,
tokens/s = (prompt + generated tokens) / wall time of generate(); and RoutingCacheManager.gather of R
rows through a shuffled block table (median of many calls).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

# tools/ is run as a script from a checkout where the package is not necessarily installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fake_model import make_fake_model
from model_presets import add_model_args, bench_model

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer, RoutingBufferSpec
from fastdeploy_r3.cache_manager.routing_cache_manager import RoutingCacheManager
from fastdeploy_r3.cache_manager.shm import new_engine_suffix, shm_name, unlink_all


def bench_throughput(
    model_dir: str, rounds: int, num_prompts: int, prompt_len: int, max_tokens: int, device: str = "auto"
) -> dict:
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 500, prompt_len)] for _ in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # Both engines live at once: on CUDA each would otherwise size its KV cache to 90 % of free memory.
    blocks = None if device == "cpu" else num_prompts * (-(-(prompt_len + max_tokens) // 16)) + 16
    engines = {
        on: LLM(model_dir, block_size=16, enable_prefix_caching=False, max_num_seqs=num_prompts, device=device,
                num_gpu_blocks_override=blocks, routing_replay_config={"enable_routing_replay": on})
        for on in (True, False)
    }
    tps: dict[bool, list[float]] = {True: [], False: []}
    try:
        for r in range(rounds + 1):  # round 0 warms up
            for on in (True, False) if r % 2 else (False, True):
                t0 = time.perf_counter()
                outs = engines[on].generate(prompts, params, use_tqdm=False)
                dt = time.perf_counter() - t0
                n_out = sum(len(o.outputs[0].token_ids) for o in outs)
                if on:
                    assert all(o.outputs[0].routed_experts is not None for o in outs), "R3 failed in the bench"
                if r:
                    tps[on].append((num_prompts * prompt_len + n_out) / dt)
    finally:
        for llm in engines.values():
            llm.shutdown()
    return {on: statistics.median(v) for on, v in tps.items()} | {"rounds": tps}


def bench_gather(num_rows_list: list[int], block_size: int, num_layers: int, top_k: int, num_experts: int) -> dict:
    num_blocks = max(num_rows_list) // block_size
    suffix = new_engine_suffix()
    spec = RoutingBufferSpec(shm_name(suffix, "routing_host"), num_blocks * block_size, num_layers, top_k, "uint8")
    buf = RoutingBuffer.create(spec)
    try:
        rng = np.random.default_rng(0)
        buf.rows[:] = rng.integers(0, num_experts, buf.rows.shape, dtype=np.uint8)
        block_table = [int(b) for b in rng.permutation(num_blocks)]
        block_tags = list(range(1, num_blocks + 1))
        for b, tag in zip(block_table, block_tags):
            buf.tags[b * block_size : (b + 1) * block_size] = tag
        rcm = RoutingCacheManager(buf, block_size, num_experts)
        out = {}
        for rows in num_rows_list:
            n = max(20, 200_000 // rows)
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                rcm.gather("bench", block_table, block_tags, 0, rows)
                times.append(time.perf_counter() - t0)
            out[rows] = statistics.median(times) * 1e6  # µs per call
        return out
    finally:
        buf.close()
        unlink_all(suffix)


# -- engine mode ------------------------------------------------------------------------------------


def copy_bandwidth(device: str) -> float:
    """Bytes read + written per second by a large copy on `device` (median of 10 after 3 warm-ups)."""
    import torch

    n = (1 << 30) if device == "cuda" else (1 << 27)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(13):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(times[3:])


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """num prompts of `length` tokens; groups of 4 share their first half (the shared-prefix shape of RL
    rollouts; this runner-level bench computes every token, so they cost what distinct prompts cost)."""
    rng = np.random.default_rng(seed)
    half = length // 2
    prefixes = [rng.integers(0, vocab - 8, half).tolist() for _ in range(-(-num // 4))]
    return [prefixes[i // 4] + rng.integers(0, vocab - 8, length - half).tolist() for i in range(num)]


def profile_steps(bench, steps: int, path: str) -> dict:  # noqa: ANN001
    """torch.profiler over `steps` decode steps: the table goes to `path`; returns the headline counts."""
    from step_bench import profile_table

    bench.decode([True])  # warm
    events, wall = profile_table(lambda: bench.decode([True] * steps), bench.runner.device.type, path)
    cuda = bench.runner.device.type == "cuda"
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"  # FunctionEventAvg's name for it
    count = {e.key: e.count for e in events}
    gpu_us = sum(getattr(e, "self_device_time_total", 0) for e in events if e.device_type.name == "CUDA")
    return {
        "wall_ms_per_step": wall / steps * 1e3,
        "gpu_busy_ms_per_step": gpu_us / steps / 1e3,
        "launches_per_step": sum(c for k, c in count.items() if k in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                       "cudaLaunchKernelExC")) / steps,
        "syncs_per_step": sum(c for k, c in count.items() if "Synchronize" in k) / steps,
        "nonzero_per_step": count.get("aten::nonzero", 0) / steps,
        "top": [(e.key, getattr(e, attr, 0) / steps / 1e3)
                for e in sorted(events, key=lambda e: -getattr(e, attr, 0))[:12]],
    }


def bench_engine(args: argparse.Namespace, model_dir: str, load_format: str) -> dict:
    from step_bench import StepBench

    batches = [int(b) for b in args.batches.split(",")]
    steps = args.decode_steps
    # decode tokens per request: warm-up, timed, roofline, pipelined warm-up and timed, profiled steps
    extra = 2 * steps + 16
    max_len = max(args.prompt_len + extra, args.prefill_len + 1)
    block_size = 16
    per_req = -(-(args.prompt_len + extra) // block_size)
    num_blocks = max(max(batches) * per_req, args.prefill_prompts * (-(-(args.prefill_len + 1) // block_size))) + 1
    bw = copy_bandwidth(args.device)
    bench = StepBench(model_dir, args.device, args.dtype, load_format, max(batches), max_len, num_blocks, block_size,
                      args.max_num_batched_tokens, args.enforce_eager, args.enable_deterministic_inference,
                      args.quantization)  # fmt: skip
    vocab = bench.runner.model.vocab_size
    graphs = bench.runner.decode_graphs
    print(f"model loaded in {bench.load_s:.1f} s; decode CUDA graphs: "
          f"{graphs.sizes if graphs else 'none'} ({bench.graph_capture_s:.1f} s); "
          f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    rows = []
    profiles: dict[int, dict] = {}
    profile_at = {int(b) for b in str(args.profile_batch).split(",") if b}
    try:
        for b in batches:
            bench.prefill(random_prompts(b, args.prompt_len, vocab, seed=b), reserve=extra)
            bench.decode([True, False])  # warm-up (first launches compile Triton kernels for this shape)
            bench.host_prep_s.clear()
            times = bench.decode([i % 2 == 0 for i in range(2 * (steps // 2))])
            on, off = statistics.median(times[0::2]), statistics.median(times[1::2])
            bench.decode([True])
            host_prep = statistics.median(bench.host_prep_s)  # of the synchronous steps only
            nbytes = bench.roofline_bytes(b)
            roof = sum(v for k, v in nbytes.items() if k != "experts_touched_per_layer") / bw
            bench.decode_pipelined(2)  # warm-up: the first placeholder feed, launches overlapping a finish
            piped = statistics.median(bench.decode_pipelined(steps))
            row = {"batch": b, "step_ms": on * 1e3, "step_r3_off_ms": off * 1e3, "roofline_ms": roof * 1e3,
                   "ratio": on / roof, "pipelined_ms": piped * 1e3, "pipelined_ratio": piped / roof, "tok_s": b / on,
                   "r3_on_off": off / on, "host_prep_us": host_prep * 1e6, "bytes": nbytes}  # fmt: skip
            rows.append(row)
            print(f"batch {b:4d}: step {on * 1e3:8.2f} ms (R3 off {off * 1e3:8.2f}, pipelined {piped * 1e3:8.2f}), "
                  f"roofline {roof * 1e3:7.3f} ms ({nbytes['experts_touched_per_layer']:.0f} experts/layer), "
                  f"ratio {on / roof:6.1f} (pipelined {piped / roof:6.1f})", flush=True)
            if b in profile_at and args.out:
                profiles[b] = profile_steps(bench, 3, os.path.join(args.out, f"profile_bs{b}.txt"))
        prompts = random_prompts(args.prefill_prompts, args.prefill_len, vocab, seed=4096)
        bench.prefill(prompts[:1])  # warm-up at this length
        prefill_s = bench.prefill(prompts)
        prefill_tok_s = args.prefill_prompts * args.prefill_len / prefill_s
    finally:
        bench.close()
    return {"copy_bandwidth": bw, "rows": rows, "prefill_tok_s": prefill_tok_s, "profiles": profiles,
            "cuda_graphs": graphs is not None}


def bench_hf(model_dir: str, device: str, dtype: str, batches: list[int], prompt_len: int, steps: int) -> dict:
    """HF transformers' decode step on the same config (random weights), median of `steps` steps."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype)).eval()
    out = {}
    with torch.inference_mode():
        for b in batches:
            ids = torch.randint(0, cfg.vocab_size - 8, (b, prompt_len), device=device)
            res = model(ids, use_cache=True)
            past, nxt = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                res = model(nxt, past_key_values=past, use_cache=True)
                nxt = res.logits[:, -1].argmax(-1, keepdim=True)
                nxt.cpu()
                times.append(time.perf_counter() - t0)
                past = res.past_key_values
            out[b] = statistics.median(times[1:]) * 1e3
            print(f"HF transformers batch {b}: step {out[b]:.2f} ms", flush=True)
    return out


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(batches, [r["step_ms"] for r in rows], "o-", label="decode step (R3 on)")
    ax1.plot(batches, [r["roofline_ms"] for r in rows], "s--", label="memory roofline")
    ax1.set(xscale="log", yscale="log", xlabel="batch", ylabel="ms", title="decode step vs roofline")
    ax1.legend()
    ax2.plot(batches, [r["r3_on_off"] for r in rows], "o-")
    ax2.axhline(0.99, color="gray", linestyle=":", label="target 0.99")
    ax2.set(xscale="log", xlabel="batch", ylabel="tokens/s R3 on / off", title="cost of R3")
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_engine_table(res: dict, hf: dict, title: str) -> None:
    print(f"\n{title}; decode CUDA graphs {'on' if res['cuda_graphs'] else 'off'}; "
          f"copy bandwidth {res['copy_bandwidth'] / 1e12:.3f} TB/s\n")
    print("| batch | step ms | roofline ms | step / roofline | pipelined step ms | pipelined / roofline "
          "| output tok/s | R3 on/off | host prep µs | experts/layer |" + (" HF step ms |" if hf else ""))
    print("| ----- | ------- | ----------- | --------------- | ----------------- | -------------------- "
          "| ------------ | --------- | ------------ | ------------- |" + (" ---------- |" if hf else ""))
    for r in res["rows"]:
        line = (f"| {r['batch']:5d} | {r['step_ms']:7.2f} | {r['roofline_ms']:11.3f} | {r['ratio']:15.1f} | "
                f"{r['pipelined_ms']:17.2f} | {r['pipelined_ratio']:20.1f} | {r['tok_s']:12.1f} | "
                f"{r['r3_on_off']:9.3f} | {r['host_prep_us']:12.0f} | "
                f"{r['bytes']['experts_touched_per_layer']:13.1f} |")
        print(line + (f" {hf.get(r['batch'], float('nan')):10.2f} |" if hf else ""))
    print(f"\nprefill: {res['prefill_tok_s']:.0f} tokens/s")
    for b, p in sorted(res["profiles"].items()):
        print(f"\nprofile at batch {b}, {p['wall_ms_per_step']:.2f} ms/step wall: "
              f"GPU busy {p['gpu_busy_ms_per_step']:.2f} ms, "
              f"{p['launches_per_step']:.0f} launches, {p['syncs_per_step']:.0f} syncs, "
              f"{p['nonzero_per_step']:.0f} nonzero per step; top ops (ms/step):")
        for key, ms in p["top"]:
            print(f"    {ms:8.3f}  {key[:100]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("engine", "cost"), default="engine")
    add_model_args(ap)
    ap.add_argument("--batches", default=None, help="default 1,16,64,256 on CUDA, 1,4 on the CPU")
    ap.add_argument("--prompt-len", type=int, default=None, help="engine default 1024 (CPU 32); cost default 64")
    ap.add_argument("--decode-steps", type=int, default=16,
                    help="timed decode steps per batch (half R3 off); as many again pipelined (R3 on)")
    ap.add_argument("--prefill-prompts", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=None, help="default 4096 on CUDA, 64 on the CPU")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--enforce-eager", action="store_true", help="no decode CUDA graphs")
    ap.add_argument("--quantization", choices=("fp8",), default=None,
                    help="fp8: block-wise fp8 experts and linears, quantized at load; the roofline counts their bytes")
    ap.add_argument("--enable-deterministic-inference", action="store_true",
                    help="the batch-invariant kernels (run once with, once without: the mode's cost)")
    ap.add_argument("--profile-batch", default="16", help="batch sizes to profile, e.g. 1,256 (needs --out)")
    ap.add_argument("--png", default=None)
    ap.add_argument("--out", default=None, help="directory for the profile table and bench.json")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers on the same shape")
    ap.add_argument("--rounds", type=int, default=3, help="cost mode")
    ap.add_argument("--prompts", type=int, default=8, help="cost mode")
    ap.add_argument("--max-tokens", type=int, default=32, help="cost mode")
    args = ap.parse_args()
    if args.mode == "cost":
        args.prompt_len = args.prompt_len or 64
        return main_cost(args)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, load_format, title = bench_model(args, tmp)
        cuda = args.device == "cuda"
        args.batches = args.batches or ("1,16,64,256" if cuda else "1,4")
        args.prompt_len = args.prompt_len or (1024 if cuda else 32)
        args.prefill_len = args.prefill_len or (4096 if cuda else 64)
        with open(os.path.join(model_dir, "config.json")) as f:
            num_layers = json.load(f)["num_hidden_layers"]
        title += f", {num_layers} layers, {args.dtype}, {args.device}, prompt {args.prompt_len}"
        res = bench_engine(args, model_dir, load_format)
        hf = {}
        if args.hf:
            try:
                hf = bench_hf(model_dir, args.device, args.dtype, [r["batch"] for r in res["rows"]],
                              args.prompt_len, max(4, args.decode_steps // 2))  # fmt: skip
            except Exception as exc:  # noqa: BLE001 (the HF comparison is optional; say why it is missing)
                print(f"HF transformers comparison failed: {type(exc).__name__}: {str(exc)[:300]}")
    if args.png:
        plot(res["rows"], args.png, title)
    if args.out:
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump({"title": title, "args": vars(args), "hf_step_ms": hf} | res, f, indent=1, default=str)
    print_engine_table(res, hf, title)


# -- cost mode --------------------------------------------------------------------------------------


def main_cost(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_fake_model("qwen3_moe", tmp, preset="small")
        t0 = time.perf_counter()
        tp = bench_throughput(model_dir, args.rounds, args.prompts, args.prompt_len, args.max_tokens, args.device)
        t_tp = time.perf_counter() - t0
    # small preset: 8 MoE layers, top-8 of 64 experts -> 64 B per row
    gather = bench_gather([64, 1024, 8192], block_size=16, num_layers=8, top_k=8, num_experts=64)

    print(f"\nR3 cost, fake `small` qwen3_moe (8 MoE layers, top-8 of 64), float32, {os.cpu_count()} CPU cores")
    print(f"batch: {args.prompts} prompts x {args.prompt_len} tokens + {args.max_tokens} greedy tokens, "
          f"{args.rounds} interleaved rounds each ({t_tp:.0f} s)\n")
    print("| metric                         | R3 on    | R3 off   | on / off |")
    print("| ------------------------------ | -------- | -------- | -------- |")
    print(f"| tokens/s (median)              | {tp[True]:8.1f} | {tp[False]:8.1f} | {tp[True] / tp[False]:8.3f} |")
    for on in (True, False):
        rounds = ", ".join(f"{x:.1f}" for x in tp["rounds"][on])
        print(f"|   rounds R3 {'on ' if on else 'off'}               | {rounds}")
    print("\n| gather (block_size 16, 64 B/row) | µs per call | µs per 1k rows |")
    print("| -------------------------------- | ----------- | -------------- |")
    for rows, us in gather.items():
        print(f"| {rows:>6} rows                      | {us:11.1f} | {us * 1000 / rows:14.1f} |")


if __name__ == "__main__":
    main()
