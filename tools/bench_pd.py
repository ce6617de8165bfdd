"""Prefill/decode disaggregation (docs/pd.md) against a colocated server, on servers started here: a
redis-server as the shared KV store, P, D, the registry's sglang-router in PD mode, and one colocated
server with the same flags.

    python tools/bench_pd.py --model DIR [--device cuda] [--block-size 16] [--prompts 32]
        [--prompt-len 64:512] [--max-tokens 64] [--concurrency 8] [--server-arg=--max-num-seqs=64 ...]
    python tools/bench_pd.py --fake                       # a tiny fake model on the CPU (a smoke run)
    python tools/bench_pd.py --fake --backend mooncake    # the Mooncake Transfer Engine backend

It prints, for the chosen backend (`store`: a redis-server P and D share; `mooncake`: each server its
own file store, blocks moving P -> D over Mooncake Transfer Engine):
  handoff    per fresh prompt sent to P alone: P's prefill until its handoff is published (the
             write-through of its blocks included), then D's first token once the handoff is there
             (fetch, the transfer or the storage loads, the first token computed on D), and the most
             prompt tokens D computed itself (its cached_tokens short of the prompt: 0 when every block,
             the partial last one too, arrived);
             mooncake: also the transfer itself (P's writes into the blocks D's engine reserved and
             D's checks; on CUDA into its CTM's landing buffer, checked, then one copy to the device)
  bytes      per prompt token moved: KV and R3 rows (rows: the blob's bytes beyond the KV, header and
             checksum included), from the blobs P stored for the transfer
  load       TTFT and TPOT p50 / p99 of a mixed load (random prompt lengths, shared prefixes across
             half of the prompts), streamed /generate, through the router vs the colocated server
Before anything is timed, --warmup-prompts other prompts of the same lengths go through both (kernel
compiles and first connections would otherwise land in the first figures: p99 TTFT through PD moved
1.5-5.9 s between two runs without it).
On one GPU P, D and the colocated server share the device: pass --server-arg=--gpu-memory-utilization=0.25.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time

import httpx

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))  # the launchers the tests use

from pd_deployment import pd_deployment  # noqa: E402

R3_ON = json.dumps({"enable_routing_replay": True})


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, float, int]:
    """(TTFT, TPOT, prompt tokens the server did not compute: its cached_tokens) of one streamed /generate."""
    sent = time.perf_counter()
    times: list[float] = []
    seen = cached = 0
    async with client.stream("POST", f"{url}/generate", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                n = len(chunk["output_ids"])
                times += [time.perf_counter()] * (n - seen)
                seen, cached = n, chunk["meta_info"].get("cached_tokens", cached)
    ttft = times[0] - sent
    return ttft, (times[-1] - times[0]) / max(len(times) - 1, 1), cached


async def handoffs(p: str, d: str, bootstrap_port: int, prompts: list[list[int]]) -> list[tuple[float, float, int]]:
    """Per prompt: P's prefill until published, D's first token after it, the prompt tokens D computed."""
    out = []
    async with httpx.AsyncClient(timeout=600) as client:
        for room, prompt in enumerate(prompts, start=10_000):
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
                    "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": room}
            t0 = time.perf_counter()
            poll = asyncio.create_task(client.get(f"http://127.0.0.1:{bootstrap_port}/pd/rooms/{room}",
                                                  params={"wait_s": 20}))
            (await client.post(f"{p}/generate", json=body)).raise_for_status()
            (await poll).raise_for_status()
            published = time.perf_counter() - t0
            ttft, _, cached = await _stream(client, d, body)
            out.append((published, ttft, len(prompt) - cached))
    return out


async def load(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[list, list]:
    sem = asyncio.Semaphore(concurrency)
    ttfts, tpots = [], []
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(prompt: list[int]) -> None:
            async with sem:
                body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                                                 "ignore_eos": True}}
                ttft, tpot, _ = await _stream(client, url, body)
                ttfts.append(ttft)
                tpots.append(tpot)

        await asyncio.gather(*(one(p) for p in prompts))
    return ttfts, tpots


def _files(root: str) -> set[str]:
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--fake", action="store_true", help="a tiny fake glm4_moe on the CPU")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", default="32:128")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("--backend", choices=("store", "mooncake"), default="store")
    ap.add_argument("--warmup-prompts", type=int, default=None,
                    help="other prompts of the same lengths sent through PD and the colocated server before "
                         "anything is timed (default: --prompts; 0: none), so that neither side's first "
                         "requests (kernel compiles, first connections) land in the figures")
    args = ap.parse_args()
    logs = tempfile.mkdtemp(prefix="bench_pd_")
    if args.fake:
        from fake_model import make_fake_model

        args.model = make_fake_model("glm4_moe", os.path.join(logs, "model"))
    lo, hi = (int(x) for x in args.prompt_len.split(":"))
    with open(os.path.join(args.model, "config.json")) as f:
        hf = json.load(f)
    vocab = int(hf["vocab_size"])
    rng = random.Random(0)
    shared = [rng.randrange(vocab) for _ in range(lo)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]
               for i in range(args.prompts)]
    n_warm = args.prompts if args.warmup_prompts is None else args.warmup_prompts
    warm = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n_warm)]
    common = ("--device", args.device, "--routing-replay-config", R3_ON, "--block-size", str(args.block_size),
              *args.server_arg)
    with pd_deployment(args.model, logs, common, timeout=900, backend=args.backend) as dep:
        for url in (dep.router, dep.colocated.url) if warm else ():
            asyncio.run(load(url, warm, args.max_tokens, args.concurrency))
        fresh = [[rng.randrange(vocab) for _ in range(hi)] for _ in range(4)]
        moved: list[tuple[int, int, float]] = []
        if args.backend == "store":
            import redis

            store = redis.Redis.from_url(dep.store_url)
            keys_before = set(store.keys("*"))
            hand = asyncio.run(handoffs(dep.prefill.url, dep.decode.url, dep.bootstrap_port, fresh))
            blobs = [store.strlen(k) for k in set(store.keys("*")) - keys_before if store.type(k) == b"string"]
        else:
            p_store = os.path.join(logs, "p_store")  # what P stored is what it sends (D's engine or store)
            files_before = _files(p_store)
            log_at = os.path.getsize(dep.decode.log_path)
            hand = asyncio.run(handoffs(dep.prefill.url, dep.decode.url, dep.bootstrap_port, fresh))
            blobs = [os.path.getsize(f) for f in _files(p_store) - files_before]
            with open(dep.decode.log_path) as f:
                f.seek(log_at)
                moved = [(int(n), int(b), float(s)) for n, b, s in re.findall(
                    r"(\d+) blocks \((\d+) bytes\) over the transfer engine in ([0-9.]+) s", f.read())]
        heads, kv_heads = int(hf["num_attention_heads"]), int(hf.get("num_key_value_heads", hf["num_attention_heads"]))
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
        itemsize = 2 if hf.get("torch_dtype") in ("bfloat16", "float16") else 4
        kv_per_token = int(hf["num_hidden_layers"]) * 2 * kv_heads * head_dim * itemsize
        per_token = sum(blobs) / (len(blobs) * args.block_size) if blobs else float("nan")
        pd_ttft, pd_tpot = asyncio.run(load(dep.router, prompts, args.max_tokens, args.concurrency))
        co_ttft, co_tpot = asyncio.run(load(dep.colocated.url, prompts, args.max_tokens, args.concurrency))
    print("backend store (redis)" if args.backend == "store" else "backend mooncake (transfer engine, tcp)")
    if args.backend == "mooncake" and moved:
        ms, blocks, nbytes = (statistics.median(m[i] for m in moved) for i in (2, 0, 1))
        print(f"transfer  a room over the transfer engine: p50 {ms * 1e3:.1f} ms for {blocks:.0f} blocks "
              f"({nbytes:.0f} bytes; {len(moved)} rooms)")
    print(f"handoff   P prefill until published: p50 {statistics.median(h[0] for h in hand) * 1e3:.1f} ms; "
          f"D first token after it: p50 {statistics.median(h[1] for h in hand) * 1e3:.1f} ms "
          f"({len(hand)} prompts of {hi} tokens; D computed {max(h[2] for h in hand)} prompt tokens at most: the "
          f"rest arrived from P)")
    print(f"bytes     per prompt token: KV {kv_per_token} B, R3 rows {per_token - kv_per_token:.1f} B "
          f"(blob {per_token:.1f} B over {len(blobs)} blobs)")
    for name, ttft, tpot in (("PD", pd_ttft, pd_tpot), ("colocated", co_ttft, co_tpot)):
        print(f"load      {name:9s} TTFT p50 {_pct(ttft, 0.5) * 1e3:8.1f} ms p99 {_pct(ttft, 0.99) * 1e3:8.1f} ms | "
              f"TPOT p50 {_pct(tpot, 0.5) * 1e3:7.2f} ms p99 {_pct(tpot, 0.99) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
