"""Tensor-parallel throughput through the whole engine: TP=1 vs TP=N on the same preset, same prompts.

    python tools/bench_tp.py --preset qwen3-30b-a3b --tp 2 [--batch 64] [--prompt-len 512] [--max-tokens 128]
        [--dtype bfloat16] [--layers N]

Each engine (dummy weights drawn on the GPUs, R3 on) generates --batch greedy requests of --prompt-len
random tokens and --max-tokens outputs; one engine lives at a time. The table gives wall time, output
tokens/s, how many requests' greedy tokens equal TP=1's, and, over the prompt rows (the same tokens on
both sides, whatever was sampled), the share of R3 rows equal in every layer, in the first MoE layer,
and of single [row, layer, k] ids. TP sums partial products in another order, so in bf16 a router
near-tie flips now and then and the flip propagates through later layers; in float32 (--dtype float32,
with --layers cutting the preset to fit) flips are rare, which tells a sharding bug from rounding.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model_presets import write_preset  # noqa: E402

from fastdeploy_r3 import LLM, SamplingParams  # noqa: E402


def run(model_dir: str, tp: int, prompts: list[list[int]], max_tokens: int, dtype: str) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model_dir, load_format="dummy", dtype=dtype, device="cuda", tensor_parallel_size=tp,
             max_num_seqs=len(prompts), max_num_batched_tokens=8192, enable_prefix_caching=False,
             routing_replay_config={"enable_routing_replay": True}) as llm:  # fmt: skip
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "out_tok_s": len(prompts) * max_tokens / wall,
        "tokens": [o.outputs[0].token_ids for o in outs],
        "rows": [o.outputs[0].routed_experts for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=None, help="cut the preset to this many layers")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 30000, args.prompt_len)] for _ in range(args.batch)]
    with tempfile.TemporaryDirectory() as d:
        model_dir = write_preset(args.preset, os.path.join(d, args.preset), args.layers)
        results = {tp: run(model_dir, tp, prompts, args.max_tokens, args.dtype) for tp in (1, args.tp)}
    base = results[1]
    p = args.prompt_len - 1  # prompt rows: [P - 1] of every request, fed identically on both sides
    print(f"{args.preset}, {args.layers or 'all'} layers, {args.dtype}, batch {args.batch}, "
          f"prompt {args.prompt_len}, output {args.max_tokens}")
    print("| TP | wall s | output tok/s | tokens equal TP=1 | prompt rows equal (all layers) "
          "| prompt rows equal (first MoE layer) | prompt ids equal |")
    print("|---|---|---|---|---|---|---|")
    for tp, r in results.items():
        same = sum(a == b for a, b in zip(r["tokens"], base["tokens"]))
        a = np.stack([x[:p] for x in r["rows"]])  # [B, P - 1, L, K]
        b = np.stack([x[:p] for x in base["rows"]])
        rows_all = float((a == b).all(axis=(2, 3)).mean())
        rows_first = float((a[:, :, 0] == b[:, :, 0]).all(axis=-1).mean())
        ids = float((np.sort(a, -1) == np.sort(b, -1)).mean())
        print(f"| {tp} | {r['wall_s']:.2f} | {r['out_tok_s']:.0f} | {same}/{len(prompts)} | {rows_all:.4f} "
              f"| {rows_first:.4f} | {ids:.4f} |")


if __name__ == "__main__":
    main()
