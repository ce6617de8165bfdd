"""The cost of R3 on this machine: end-to-end tokens/s with R3 on vs off, and the gather at finish.

    python tools/bench_r3.py [--rounds 3] [--prompts 8] [--prompt-len 64] [--max-tokens 32] [--device cuda]

Throughput: one engine with R3 on and one with it off, both on the fake `small` qwen3_moe (float32),
prefix caching off so every round computes the same work; rounds alternate on/off (after one warm-up
round each) so a noisy neighbour hits both alike. tokens/s = (prompt + generated tokens) / wall time of
one generate() over the whole batch, greedy; the table shows the median over rounds.

Gather: RoutingCacheManager.gather of R rows through a shuffled block table over a host buffer whose
rows and tags are all valid (the path every finished request takes), median of many calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

# tools/ is run as a script from a checkout where the package is not necessarily installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fake_model import make_fake_model

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = ap.parse_args()

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
