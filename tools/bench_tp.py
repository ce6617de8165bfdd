"""Tensor-parallel throughput through the whole engine: TP=1 vs TP=N on the same preset, same prompts.

    python tools/bench_tp.py --preset qwen3-30b-a3b --tp 2 [--batch 64] [--prompt-len 512] [--max-tokens 128]

Each engine (dummy weights drawn on the GPUs, bf16, R3 on) generates --batch greedy requests of
--prompt-len random tokens and --max-tokens outputs; the table gives wall time, output tokens/s and
whether the greedy tokens and R3 rows of TP=N equal TP=1's (counting differing rows; with dummy
bf16 weights near-ties can flip a few). One engine lives at a time.
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


def run(model_dir: str, tp: int, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model_dir, load_format="dummy", dtype="bfloat16", device="cuda", tensor_parallel_size=tp,
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
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 30000, args.prompt_len)] for _ in range(args.batch)]
    with tempfile.TemporaryDirectory() as d:
        model_dir = write_preset(args.preset, os.path.join(d, args.preset))
        results = {tp: run(model_dir, tp, prompts, args.max_tokens) for tp in (1, args.tp)}
    base = results[1]
    print("| TP | wall s | output tok/s | tokens equal TP=1 | R3 rows differing from TP=1 |")
    print("|---|---|---|---|---|")
    for tp, r in results.items():
        same = sum(a == b for a, b in zip(r["tokens"], base["tokens"]))
        rows = sum(int((a != b).any(axis=(1, 2)).sum()) for a, b in zip(r["rows"], base["rows"]) if a.shape == b.shape)
        total = sum(a.shape[0] for a in base["rows"])
        print(f"| {tp} | {r['wall_s']:.2f} | {r['out_tok_s']:.0f} | {same}/{len(prompts)} | {rows}/{total} |")


if __name__ == "__main__":
    main()
