"""The rollout benchmark: an RL-shaped batch through the server's SGLang `/generate`, measured as the
trainer sees it (wall time of the whole rollout, output tokens/s, TTFT and TPOT per sample).

    python tools/bench_rollout.py --model DIR [--device cuda --load-format dummy] [--prompts 128 --n 8]
        [--prompt-len 256:2048] [--max-tokens 4096] [--r3 on|off|both] [--ignore-eos]
        [--concurrency 0] [--png rollout.png] [--out DIR] [--server-arg=--max-num-seqs=256 ...]
    python tools/bench_rollout.py --url http://127.0.0.1:8000 ...          # a server already running
    python tools/bench_rollout.py --model DIR --concurrency-sweep 1,64,256 --prompt-len 512 \
        --max-tokens 256 --output-len fixed --ignore-eos                    # the concurrency table

A rollout is P prompts x n samples. Prompt lengths are uniform in --prompt-len (random token ids, so no
two prompts share a prefix; the n samples of one prompt do); output lengths are drawn from a log-normal
with a long tail and capped at --max-tokens (`--output-len fixed`: every sample asks for --max-tokens).
Each sample is one streamed `/generate` request (slime's streaming rollout; its default is one answer
per sample: --no-stream), at most --concurrency in flight (0: all at once); --return-logprob asks for
every token's logprob, as slime's and miles' bodies do. Per run it prints the rollout wall time, output
tokens/s, TTFT p50/p99, TPOT p50/p99 and, when the engine exports its step counters on /metrics, the
mean engine step beside the server TPOT. `--r3 both` runs R3 off and on alternately (--pairs times) on
servers started here and prints their ratio (per concurrency with --concurrency-sweep, each server
running the whole sweep). --png plots tokens/s and requests in flight over time. Each run also prints
the host CPU per output token of the client (this process) and of the API server it started: a process
near 100 % of the wall time is what the rollout waits on, not the engine. A speculative server
(`'--server-arg=--speculative-config={"method": "ngram", "num_speculative_tokens": 3}'`) also gets the
drafts its steps fed and the share accepted (/metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))  # the server launcher the tests use

from api_server_process import api_server  # noqa: E402
from rollout_report import HEADER, plot, r3_ratios, row  # noqa: E402

R3_ON = json.dumps({"enable_routing_replay": True, "routing_store_type": "response"})
R3_OFF = json.dumps({"enable_routing_replay": False})


@dataclass
class Sample:
    prompt_ids: list[int]
    max_tokens: int
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival time of each chunk's new tokens
    tokens: int = 0
    error: str | None = None
    streamed: bool = True  # False (--no-stream): token_times holds the answer's arrival once per token

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times and self.streamed else None

    @property
    def tpot(self) -> float | None:
        if self.tokens < 2 or not self.streamed:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.tokens - 1)


@dataclass
class RunResult:
    label: str
    wall_s: float
    samples: list[Sample]
    step_ms: float | None
    timeline: list[tuple[float, int, int]]  # (t, tokens so far, in flight)
    step_split_ms: dict[str, float] = field(default_factory=dict)  # mean ms per step of each STEP_PARTS
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds of the run: "API server", "client"
    spec: dict[str, float] = field(default_factory=dict)  # a speculative server's verify_steps, draft / accepted_tokens

    @property
    def output_tokens(self) -> int:
        return sum(s.tokens for s in self.samples)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def make_rollout(args: argparse.Namespace, vocab: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    lo, hi = (int(x) for x in args.prompt_len.split(":")) if ":" in args.prompt_len else (int(args.prompt_len),) * 2
    samples = []
    for _ in range(args.prompts):
        prompt = [int(t) for t in rng.integers(0, vocab, int(rng.integers(lo, hi + 1)))]
        for _ in range(args.n):
            if args.output_len == "fixed":
                out = args.max_tokens
            else:  # log-normal: median max_tokens / 8, a tail to the cap
                out = int(min(args.max_tokens, max(1, rng.lognormal(np.log(args.max_tokens / 8), 1.0))))
            samples.append(Sample(prompt, out))
    return samples


async def _one(client: httpx.AsyncClient, url: str, s: Sample, args: argparse.Namespace, r3: bool) -> None:
    body = {
        "input_ids": s.prompt_ids,
        "sampling_params": {"max_new_tokens": s.max_tokens, "temperature": args.temperature,
                            "ignore_eos": args.ignore_eos},
        "stream": not args.no_stream,
        "return_routed_experts": r3,
    }
    if args.return_logprob:  # as slime's and miles' bodies ask (tests/fixtures/rl_frameworks)
        body["return_logprob"] = True
    s.sent = time.monotonic()
    try:
        if args.no_stream:  # slime's default: one answer per sample
            resp = await client.post(f"{url}/generate", json=body)
            if resp.status_code != 200:
                s.error = f"{resp.status_code}: {resp.text[:200]!r}"
                return
            s.tokens, s.streamed = int(resp.json()["meta_info"]["completion_tokens"]), False
            s.token_times = [time.monotonic()] * s.tokens
            return
        async with client.stream("POST", f"{url}/generate", json=body) as resp:
            if resp.status_code != 200:
                s.error = f"{resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    s.error = str(chunk["error"])[:200]
                    return
                done = chunk.get("meta_info", {}).get("completion_tokens", s.tokens)
                now = time.monotonic()
                s.token_times.extend([now] * (done - s.tokens))
                s.tokens = done
    except httpx.HTTPError as e:
        s.error = f"{type(e).__name__}: {e}"


_STEP_RE = re.compile(
    r"^fastdeploy_r3_engine_(steps|step_seconds|step_(?:schedule|input|worker|output|send)_seconds|decode_steps"
    r"|decode_step_seconds|spec_verify_steps|spec_draft_tokens|spec_accepted_tokens)(?:_total)? "
    r"([0-9.eE+-]+)$", re.M)
STEP_PARTS = ("schedule", "input", "worker", "output", "send")  # engine/step_counters.py


async def _step_counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    with contextlib.suppress(httpx.HTTPError):
        text = (await client.get(f"{url}/metrics")).text
        return {m.group(1): float(m.group(2)) for m in _STEP_RE.finditer(text)}
    return {}


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of process pid so far (Linux /proc), None if unknown."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields_ = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


async def _client(url: str, samples: list[Sample], args: argparse.Namespace, r3: bool, limit: int,
                  on_change: Callable[[int], None] = lambda d: None) -> None:
    """Send `samples`, at most `limit` in flight, filling in their timings."""
    sem = asyncio.Semaphore(limit)
    timeout = httpx.Timeout(args.request_timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def guarded(s: Sample) -> None:
            async with sem:
                on_change(1)
                try:
                    await _one(client, url, s, args, r3)
                finally:
                    on_change(-1)

        await asyncio.gather(*(guarded(s) for s in samples))


def _client_process(url: str, samples: list[Sample], args: argparse.Namespace, r3: bool,
                    limit: int) -> tuple[list[Sample], float]:
    """One of --client-procs: its share of the samples, timed; returns them and its CPU seconds."""
    cpu0 = time.process_time()  # its start-up (imports) left out
    asyncio.run(_client(url, samples, args, r3, limit))
    return samples, time.process_time() - cpu0


def _timeline_of(samples: list[Sample], start: float, wall: float) -> list[tuple[float, int, int]]:
    """(t, tokens so far, in flight) every 0.25 s, rebuilt from the samples' own times."""
    arrivals = np.sort(np.array([t for s in samples for t in s.token_times]) - start)
    sent = np.array([s.sent - start for s in samples])
    ended = np.array([(s.token_times[-1] if s.token_times else s.sent) - start for s in samples])
    out = []
    for t in np.arange(0.0, wall, 0.25):
        out.append((float(t), int(np.searchsorted(arrivals, t, side="right")), int(((sent <= t) & (ended > t)).sum())))
    out.append((wall, len(arrivals), 0))
    return out


async def run_rollout(url: str, samples: list[Sample], args: argparse.Namespace, r3: bool, label: str,
                      server_pid: int | None = None) -> RunResult:
    limit = args.concurrency or len(samples)
    procs = max(1, min(args.client_procs, len(samples)))
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as stack, httpx.AsyncClient(timeout=30.0) as client:
        pool = None
        if procs > 1:  # started before the clock: a spawned client imports for ~0.5 s
            pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(
                procs, mp_context=multiprocessing.get_context("spawn")))
            await asyncio.gather(*(loop.run_in_executor(pool, time.sleep, 0.5) for _ in range(procs)))
        before = await _step_counters(client, url)
        cpu_before = (process_cpu_s(server_pid), time.process_time())
        start = time.monotonic()
        if pool is None:
            await _client(url, samples, args, r3, limit)
            client_cpu = time.process_time() - cpu_before[1]
        else:  # each process its share of the samples and of the concurrency (CLOCK_MONOTONIC is system-wide)
            shares = [samples[i::procs] for i in range(procs)]
            done = await asyncio.gather(*(loop.run_in_executor(
                pool, _client_process, url, share, args, r3, max(1, limit // procs)) for share in shares))
            for share, (filled, _) in zip(shares, done):
                for mine, theirs in zip(share, filled):
                    mine.__dict__.update(theirs.__dict__)
            client_cpu = sum(cpu for _, cpu in done)
        wall = time.monotonic() - start
        timeline = _timeline_of(samples, start, wall)
        cpu = {"client": client_cpu}
        if (api := process_cpu_s(server_pid)) is not None and cpu_before[0] is not None:
            cpu["API server"] = api - cpu_before[0]
        after = await _step_counters(client, url)
    step_ms = None
    # a speculative server (--server-arg=--speculative-config=...): what the run's steps drafted and kept
    spec = {k[5:]: after[k] - before.get(k, 0.0) for k in ("spec_verify_steps", "spec_draft_tokens",
                                                           "spec_accepted_tokens") if k in after}  # fmt: skip
    if {"steps", "step_seconds"} <= before.keys() & after.keys() and after["steps"] > before["steps"]:
        steps = after["steps"] - before["steps"]
        step_ms = 1e3 * (after["step_seconds"] - before["step_seconds"]) / steps
        split = {p: 1e3 * (after[k] - before[k]) / steps for p in STEP_PARTS
                 if (k := f"step_{p}_seconds") in before.keys() & after.keys()}
        decode = after.get("decode_steps", 0) - before.get("decode_steps", 0)
        if decode > 0:  # the steps that fed one token per request, no prompt chunk (send excluded)
            split[f"decode-only step ({decode:.0f} steps)"] = 1e3 * (
                after["decode_step_seconds"] - before["decode_step_seconds"]) / decode
        return RunResult(label, wall, samples, step_ms, timeline, split, cpu, spec)
    return RunResult(label, wall, samples, step_ms, timeline, cpu_s=cpu, spec=spec)


def vocab_size(model_dir: str | None) -> int:
    if model_dir is None:
        return 1000
    with open(os.path.join(model_dir, "config.json")) as f:
        return min(int(json.load(f)["vocab_size"]) - 16, 50000)  # stay clear of the special tokens at the end


@contextlib.contextmanager
def target(args: argparse.Namespace, r3_config: str, log_dir: str):
    if args.url:
        yield args.url, None
        return
    # server_command says --device cpu; a later --device wins (argparse keeps the last value).
    extra = [*args.server_arg, "--device", args.device, "--routing-replay-config", r3_config,
             "--load-format", args.load_format]
    t0 = time.monotonic()
    with api_server(args.model, log_dir, *extra, timeout=args.start_timeout_s) as h:
        print(f"server ({'R3 off' if r3_config == R3_OFF else 'R3 on'}) up in {time.monotonic() - t0:.1f} s",
              flush=True)
        yield h.url, h.proc.pid  # the API server process itself (its engine and workers are children)


async def _main(args: argparse.Namespace) -> list[RunResult]:
    vocab = vocab_size(args.model)
    results: list[RunResult] = []
    modes = {"on": [True], "off": [False], "both": [False, True] * args.pairs}[args.r3]
    sweep = [int(x) for x in args.concurrency_sweep.split(",")] if args.concurrency_sweep else [None]
    with tempfile.TemporaryDirectory(prefix="fdr3_rollout_") as log_dir:
        for i, r3 in enumerate(modes):
            pair = f"R3 {'on' if r3 else 'off'}" + (f" #{i // 2 + 1}" if args.r3 == "both" else "")
            with target(args, R3_ON if r3 else R3_OFF, log_dir) as (url, pid):
                await run_rollout(url, make_rollout(args, vocab, seed=99)[:4], args, False, "warm-up")
                for k, c in enumerate(sweep):
                    if c is None:
                        samples, label = make_rollout(args, vocab), pair
                    else:  # the concurrency table: c single-sample prompts, all in flight at once
                        args.concurrency = c
                        one_each = argparse.Namespace(**{**vars(args), "prompts": c, "n": 1})
                        # prompts of their own per run: a server's prefix cache must not serve one run's
                        # prompts to the next (the same seed made a repeated value a decode-only run)
                        samples = make_rollout(one_each, vocab, seed=1 + k)
                        label = f"concurrency {c}" + (f", {pair}" if args.r3 == "both" else "")
                    results.append(await run_rollout(url, samples, args, r3, label, pid))
                    print(row(results[-1]), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (the server is started here)")
    ap.add_argument("--url", help="a running server instead (then --r3 on|off only says what to ask for)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--server-arg", action="append", default=[], help="extra server flag, repeatable")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", default="256:2048", help="LO:HI (uniform) or one length")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--output-len", choices=("lognormal", "fixed"), default="lognormal")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--no-stream", action="store_true", help="one answer per sample (slime's default), no TTFT/TPOT")
    ap.add_argument("--return-logprob", action="store_true",
                    help="ask for each token's logprob, as slime's and miles' bodies do")
    ap.add_argument("--r3", choices=("on", "off", "both"), default="on")
    ap.add_argument("--pairs", type=int, default=3, help="off/on pairs with --r3 both")
    ap.add_argument("--concurrency", type=int, default=0, help="requests in flight at most (0: all)")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="client processes sharing the samples (one Python client parses ~5k chunks/s at most)")
    ap.add_argument("--concurrency-sweep", default="", help="e.g. 1,64,256: one rollout per value")
    ap.add_argument("--request-timeout-s", type=float, default=3600.0)
    ap.add_argument("--start-timeout-s", type=float, default=900.0)
    ap.add_argument("--png", default="")
    ap.add_argument("--out", default="", help="directory for results.json")
    args = ap.parse_args(argv)
    if not args.model and not args.url:
        ap.error("give --model (a server is started here) or --url")
    if args.url and args.r3 == "both":
        ap.error("--r3 both starts its own servers: give --model, not --url")
    results = asyncio.run(_main(args))
    print()
    print(f"rollout: {args.prompts} prompts x {args.n}, prompt {args.prompt_len}, max_tokens {args.max_tokens} "
          f"({args.output_len}), temperature {args.temperature}, ignore_eos {args.ignore_eos}")
    print(HEADER)
    for r in results:
        print(row(r))
    for r in results:
        if r.step_split_ms:
            print(f"engine step, {r.label}: " + ", ".join(f"{p} {ms:.2f} ms" for p, ms in r.step_split_ms.items()))
    for r in results:  # a process near 100 % of the wall time is what the rollout waits on
        print(f"host CPU, {r.label}: " + ", ".join(
            f"{who} {1e6 * s / max(r.output_tokens, 1):.0f} us per output token ({s / r.wall_s:.0%} of the wall time)"
            for who, s in r.cpu_s.items()))
    for r in results:
        if r.spec.get("draft_tokens"):
            print(f"speculation, {r.label}: {r.spec['draft_tokens']:.0f} drafts fed in {r.spec['verify_steps']:.0f} "
                  f"steps, {r.spec['accepted_tokens']:.0f} accepted "
                  f"({r.spec['accepted_tokens'] / r.spec['draft_tokens']:.0%})")
    for c, ratios in r3_ratios(results).items():
        if ratios:
            at = f" at concurrency {c}" if c else ""
            print(f"\nR3 on / off output tok/s{at}: median {statistics.median(ratios):.3f}, "
                  f"spread {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} pairs")
    if args.png:
        os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
        plot(results, args.png)
        print(f"plot: {args.png}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "rollout.json"), "w") as f:
            json.dump([{"label": r.label, "wall_s": r.wall_s, "output_tokens": r.output_tokens, "tok_s": r.tok_s,
                        "step_ms": r.step_ms, "cpu_s": r.cpu_s, "spec": r.spec,
                        "failed": sum(s.error is not None for s in r.samples),
                        "errors": sorted({s.error for s in r.samples if s.error})[:5]} for r in results], f, indent=1)
    return 1 if any(s.error for r in results for s in r.samples) else 0


if __name__ == "__main__":
    sys.exit(main())
