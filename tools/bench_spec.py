"""Speculative decoding's cost curve: a verify step of k drafts per request against the plain decode
step, per batch size, and the tokens/s it would give at a per-draft acceptance rate.

    python tools/bench_spec.py --preset qwen3-30b-a3b --device cuda [--layers 48] [--batches 1,8,32] [--ks 1,2,3,4,5]
        [--quantization fp8] [--profile-k 3] [--out DIR]
    python tools/bench_spec.py --preset glm-4.5-air --device cuda
    python tools/bench_spec.py --preset glm-4.5-air --device cuda --method mtp [--layers 8]
    python tools/bench_spec.py --device cpu        # the fake tiny qwen3_moe (tests/tools/test_bench_spec.py)

One ModelRunner in-process (tools/step_bench.py), dummy weights of the preset (or the fake checkpoint).
Per batch B: B random prompts, prefill, then the median of --steps plain decode steps (one token per
request; CUDA graphs unless --enforce-eager) and, per k, of --steps verify steps (the last token and k
random drafts per request, k + 1 sampling rows each; in the verify CUDA graphs of query length k + 1,
captured for each k, unless --enforce-eager). Dummy
weights accept no drafts, so acceptance is modelled: with each draft accepted with probability a
independently, a verify step appends E(a, k) = (1 - a^(k+1)) / (1 - a) tokens per request, and

    tokens/s = B * E(a, k) / verify step        speedup = that / (B / plain step)

Both steps are timed one at a time (each ends at its sampled-token sync), as an engine runs verify steps:
the next step's drafts need this step's accepted tokens, so overlap scheduling is off under speculation.
Without speculation a server launches each decode step before the previous one finishes; the plain row
also carries that pipelined step (StepBench.decode_pipelined) and each k row its speedup against it
("x pipelined plain at a=0.7"): the gain a user sees when turning speculation on.

R3 capture stays on throughout (the engine's configuration for RL rollouts).

--method mtp (a GLM preset, or the fake tiny glm4_moe with a draft layer on the CPU): the plain rows are a
plain engine's decode steps; the verify rows are an MTP engine's, each also running the draft layer's
catch-up and its k drafts after the draw (worker/mtp_drafter.py, eager).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

# tools/ is run as a script from a checkout where the package is not necessarily installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
from model_presets import add_model_args, bench_model
from step_bench import StepBench, profile_table

from fastdeploy_r3.worker.messages import ScheduledRequestData

RATES = (0.5, 0.7, 0.9)
PIPELINED_RATE = 0.7  # the acceptance rate of the table's speedup against the pipelined plain step


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verify step of k drafts appends when each draft is accepted with probability `rate`
    (until the first rejection) plus the bonus token: 1 + a + ... + a^k."""
    return float(sum(rate**i for i in range(k + 1)))


def _verify_steps(bench: StepBench, k: int, steps: int, rng: np.random.Generator, vocab: int) -> list[float]:
    """`steps` verify steps of the whole batch, each request feeding its last token and k random drafts;
    every request then moves on by the one token the dummy model keeps (its drafts' slots are rewritten
    by the next step, as after a rejection). Seconds per step."""
    times = []
    for _ in range(steps):
        step = [ScheduledRequestData(rid, [bench.last_tokens[rid]] + rng.integers(0, vocab, k).tolist(), pos, table,
                                     [1] * len(table), sample=True, num_sample_rows=k + 1)
                for rid, table, pos in bench.requests]  # fmt: skip
        bench._sync()
        t0 = time.perf_counter()
        bench._step(step)
        bench._sync()
        times.append(time.perf_counter() - t0)
        bench.requests = [(rid, table, pos + 1) for rid, table, pos in bench.requests]
    return times


def _step_bench(args: argparse.Namespace, model_dir: str, load_format: str, spec: dict | None) -> StepBench:
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    per_req = -(-(args.prompt_len + _extra(args)) // BLOCK_SIZE)
    return StepBench(model_dir, args.device, args.dtype, load_format, max(batches), args.prompt_len + _extra(args),
                     max(batches) * per_req + 1, BLOCK_SIZE, max(8192, max(batches) * (max(ks) + 1)),
                     args.enforce_eager, quantization=args.quantization, speculative_config=spec)  # fmt: skip


def _extra(args: argparse.Namespace) -> int:
    """Positions per request past its prompt: warm-ups and timed plain steps (synchronous, then pipelined),
    then per k its warm-up and timed steps, plus k lookahead, plus the --profile-k steps."""
    ks = [int(k) for k in args.ks.split(",")]
    profiled = 2 * PROFILE_STEPS if args.profile_k else 0
    pipelined = args.steps + PIPELINE_WARMUP
    return (args.steps + 1) * (len(ks) + 1) + max(ks) + 1 + profiled + pipelined


PROFILE_STEPS = 3
PIPELINE_WARMUP = 2  # pipelined steps before the timed ones (the first has no overlap)


def _plain(sb: StepBench, steps: int) -> tuple[float, float]:
    """(median synchronous decode step, median pipelined one) of the whole batch, after a warm-up each."""
    sb.decode([True])  # warm-up
    sync = statistics.median(sb.decode([True] * steps))
    sb.decode_pipelined(PIPELINE_WARMUP)
    return sync, statistics.median(sb.decode_pipelined(steps))


def _plain_steps(args: argparse.Namespace, model_dir: str, load_format: str) -> dict[int, tuple[float, float]]:
    """--method mtp: a plain engine's median decode steps per batch (_plain), in its own runner (an MTP
    runner's decode steps draft too)."""
    sb = _step_bench(args, model_dir, load_format, None)
    rng, vocab, out = np.random.default_rng(0), sb.runner.model.vocab_size, {}
    try:
        for b in (int(b) for b in args.batches.split(",")):
            sb.prefill([rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(b)], reserve=_extra(args))
            out[b] = _plain(sb, args.steps)
    finally:
        sb.close()
    return out


BLOCK_SIZE = 16


def bench(args: argparse.Namespace, model_dir: str, load_format: str) -> dict:
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    extra = _extra(args)
    mtp = getattr(args, "method", "ngram") == "mtp"
    plain_steps = _plain_steps(args, model_dir, load_format) if mtp else {}
    spec = {"method": "mtp", "num_speculative_tokens": max(ks)} if mtp else None
    sb = _step_bench(args, model_dir, load_format, spec)
    vocab = sb.runner.model.vocab_size
    cuda_graphs = sb.runner.decode_graphs is not None  # close() below drops them
    rng = np.random.default_rng(0)
    rows, verify_graph_steps = [], 0
    try:
        for b in batches:
            prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(b)]
            sb.prefill(prompts, reserve=extra)
            if mtp:
                plain, piped = plain_steps[b]
                # the positions the plain runner's steps used (sync and pipelined), decoded here
                sb.decode([True] * (1 + 2 * args.steps + PIPELINE_WARMUP))
            else:
                plain, piped = _plain(sb, args.steps)
            profile_here = args.profile_k and args.out and b == batches[0]
            if profile_here and not mtp:  # (an MTP runner's decode steps draft too: not plain steps)
                os.makedirs(args.out, exist_ok=True)
                profile_table(lambda: sb.decode([True] * PROFILE_STEPS), args.device,
                              os.path.join(args.out, f"profile_plain_bs{b}.txt"))  # fmt: skip
            rows.append({"batch": b, "k": 0, "step_ms": plain * 1e3, "cost": 1.0, "pipelined_ms": piped * 1e3,
                         "tok_s": {str(a): b / plain for a in RATES}, "speedup": {str(a): 1.0 for a in RATES},
                         "speedup_vs_pipelined": {str(a): piped / plain for a in RATES}})
            for k in ks:
                if sb.runner.drafter is not None:  # k drafts per step (its cache holds max(ks))
                    sb.runner.drafter.num_drafts = k
                if not args.enforce_eager:  # the verify graphs of this k (query length k + 1)
                    sb.runner.capture_decode_graphs(verify_query_len=k + 1)
                _verify_steps(sb, k, 1, rng, vocab)  # warm-up at this shape
                t = statistics.median(_verify_steps(sb, k, args.steps, rng, vocab))
                if profile_here and k == args.profile_k:
                    os.makedirs(args.out, exist_ok=True)
                    profile_table(lambda k=k: _verify_steps(sb, k, PROFILE_STEPS, rng, vocab), args.device,
                                  os.path.join(args.out, f"profile_verify_k{k}_bs{b}.txt"))  # fmt: skip
                graphs = sb.runner.decode_graphs
                verify_graph_steps += graphs.replays.get(k + 1, 0) if graphs is not None else 0
                tok_s = {str(a): b * expected_tokens(a, k) / t for a in RATES}
                rows.append({"batch": b, "k": k, "step_ms": t * 1e3, "cost": t / plain, "tok_s": tok_s,
                             "speedup": {a: v / (b / plain) for a, v in tok_s.items()},
                             "speedup_vs_pipelined": {a: v / (b / piped) for a, v in tok_s.items()}})
            print(f"batch {b}: plain {plain * 1e3:.2f} ms (pipelined {piped * 1e3:.2f}), verify "
                  + ", ".join(f"k={r['k']} {r['step_ms']:.2f} ms" for r in rows if r["batch"] == b and r["k"]),
                  flush=True)
    finally:
        sb.close()
    return {"rows": rows, "cuda_graphs": cuda_graphs, "verify_graph_steps": verify_graph_steps,
            "method": "mtp" if mtp else "ngram"}


def print_table(res: dict, title: str) -> None:
    where = "in CUDA graphs" if res["cuda_graphs"] else "eager"
    drafts = ", the draft layer eager" if res.get("method") == "mtp" else ""
    print(f"\n{title}; plain decode and verify {where}{drafts} ({res['verify_graph_steps']} verify steps replayed a "
          "graph)")
    head = " | ".join(f"tok/s a={a} (x)" for a in RATES)
    print(f"| batch | k | step ms | cost x plain | {head} | x pipelined plain at a={PIPELINED_RATE} |")
    print("|---|---|---|---|" + "---|" * (len(RATES) + 1))
    for r in res["rows"]:
        cells = " | ".join(f"{r['tok_s'][str(a)]:.0f} ({r['speedup'][str(a)]:.2f})" for a in RATES)
        step = f"{r['step_ms']:.2f}" + (f" (pipelined {r['pipelined_ms']:.2f})" if not r["k"] else "")
        vs_piped = r["speedup_vs_pipelined"][str(PIPELINED_RATE)]
        print(f"| {r['batch']} | {r['k'] or 'plain'} | {step} | {r['cost']:.2f} | {cells} | {vs_piped:.2f} |")


def plot(res: dict, path: str, title: str) -> None:
    """Per batch: the verify step's ms against k beside the plain step (synchronous and pipelined), and the
    modelled tokens/s of each acceptance rate over the pipelined plain step's, with the 1.8x aim marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in res["rows"]})
    fig, axes = plt.subplots(2, len(batches), figsize=(4.5 * len(batches), 7), squeeze=False)
    for col, b in enumerate(batches):
        rows = [r for r in res["rows"] if r["batch"] == b]
        plain = next(r for r in rows if not r["k"])
        verify = [r for r in rows if r["k"]]
        ks = [r["k"] for r in verify]
        top, bottom = axes[0][col], axes[1][col]
        top.plot(ks, [r["step_ms"] for r in verify], "o-", label="verify step")
        top.axhline(plain["step_ms"], color="gray", label="plain step")
        top.axhline(plain["pipelined_ms"], color="gray", linestyle="--", label="plain step, pipelined")
        top.set(xlabel="drafts k", ylabel="ms", title=f"batch {b}", xticks=ks)
        top.legend(fontsize=7)
        for a in RATES:
            bottom.plot(ks, [r["speedup_vs_pipelined"][str(a)] for r in verify], "o-", label=f"a = {a}")
        bottom.axhline(1.0, color="gray")
        bottom.axhline(TARGET_SPEEDUP, color="red", linestyle=":", label=f"{TARGET_SPEEDUP}x")
        bottom.set(xlabel="drafts k", ylabel="tokens/s over the pipelined plain step", xticks=ks)
        bottom.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


TARGET_SPEEDUP = 1.8  # the aim at batch 1, k = 3, a = 0.7 (docs/speculative.md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--batches", default=None, help="default 1,8,32 on CUDA, 1,2 on the CPU")
    ap.add_argument("--ks", default="1,2,3,4,5", help="drafts per request per verify step")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 1024 on CUDA, 16 on the CPU")
    ap.add_argument("--steps", type=int, default=16, help="timed steps per (batch, k)")
    ap.add_argument("--enforce-eager", action="store_true", help="plain decode without CUDA graphs too")
    ap.add_argument("--quantization", choices=("fp8",), default=None,
                    help="fp8: block-wise fp8 weights quantized at load, for the plain and the verify steps alike")
    ap.add_argument("--method", choices=("ngram", "mtp"), default="ngram",
                    help="mtp: verify steps also run GLM's draft layer (a GLM preset, or the fake GLM on the CPU)")
    ap.add_argument("--profile-k", type=int, default=None,
                    help=f"with --out: torch.profiler tables of {PROFILE_STEPS} plain and {PROFILE_STEPS} verify steps "
                    "of this k at the first batch (profile_plain_bsB.txt, profile_verify_kK_bsB.txt)")
    ap.add_argument("--out", default=None, help="write bench_spec.json and bench_spec.png here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.method == "mtp" and not args.preset:  # the fake GLM with a draft layer
            from fake_model import make_fake_model

            args.device = "cpu" if args.device == "auto" else args.device
            args.dtype = args.dtype or "float32"
            model_dir = make_fake_model("glm4_moe", tmp, draft_layer=True)
            load_format, title = "auto", "fake tiny glm4_moe"
        else:
            model_dir, load_format, title = bench_model(args, tmp)
        title += ", MTP drafts" if args.method == "mtp" else ""
        cuda = args.device == "cuda"
        args.batches = args.batches or ("1,8,32" if cuda else "1,2")
        args.prompt_len = args.prompt_len or (1024 if cuda else 16)
        weights = ", fp8 weights" if args.quantization else ""
        title += f", {args.dtype}{weights}, {args.device}, prompt {args.prompt_len}"
        res = bench(args, model_dir, load_format)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_spec.json"), "w") as f:
            json.dump({"title": title, "args": vars(args)} | res, f, indent=1)
        plot(res, os.path.join(args.out, "bench_spec.png"), title)
    print_table(res, title)


if __name__ == "__main__":
    main()
