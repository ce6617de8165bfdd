"""Put/get latency and throughput of the file, Redis and Mooncake stores for one 4k-token request.

    python tools/bench_stores.py [--tokens 4096] [--block-size 64] [--layers 48] [--kv-heads 4]
                                 [--head-dim 128] [--top-k 8] [--rounds 3]

Payloads, shaped like Qwen3-30B-A3B (48 MoE layers, 4 KV heads of 128, bf16, top-8) by default:
- KV: the request's tokens / block_size storage blobs (KV of one rank + the block's routing rows +
  checksum, `encode_block`), through `open_blob_store` as the CacheTransferManager uses it;
- R3 fused: one `[L, T, K]` uint8 `.npy` per request; R3 per layer: L `[T, K]` `.npy`s, through the
  routing stores as the server's delivery uses them.
Servers are started here on 127.0.0.1: a throwaway redis-server, and a mooncake_master with one
`mooncake_client` holder (the bench's client contributes no memory, so every object crosses TCP
loopback to the holder, as for data that outlives an engine). The file store writes under a temp dir
(page cache: this is not disk bandwidth). Latency is the median per object over rounds; GB/s is
payload bytes / total time of the request's objects (sequential, one client thread).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np

# tools/ runs as a script from a checkout; the server launchers are the ones the tests use.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]

from mooncake_server import mooncake_holder, mooncake_master, mooncake_url  # noqa: E402
from redis_server import redis_server  # noqa: E402

from fastdeploy_r3.blobstore import open_blob_store  # noqa: E402
from fastdeploy_r3.cache_manager.storage import BlockLayout, decode_block, encode_block  # noqa: E402
from fastdeploy_r3.r3.stores import LocalRoutingStore, RedisRoutingStore, RoutingStore  # noqa: E402

T = TypeVar("T")


@contextlib.contextmanager
def _servers(holder_bytes: int) -> Iterator[tuple[str, str]]:
    with redis_server() as redis_url, mooncake_master() as master, mooncake_holder(master, str(holder_bytes)):
        yield redis_url, mooncake_url(master, segment="0", buffer="64MB")


def _timed(fn: Callable[[], T]) -> tuple[float, T]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_kv(url: str, blobs: list[bytes], layout: BlockLayout, rounds: int) -> tuple[float, float, float, float]:
    """(put ms per block, get ms per block, put GB/s, get GB/s) of the request's blocks."""
    store = open_blob_store(url, "bench@v1")
    keys = [f"{i:064x}" for i in range(len(blobs))]
    puts, gets, put_totals, get_totals = [], [], [], []
    try:
        for _ in range(rounds):
            store.delete(keys)
            t_put = [_timed(lambda k=k, b=b: store.put(k, b))[0] for k, b in zip(keys, blobs, strict=True)]
            timed_gets = [_timed(lambda k=k: store.get(k)) for k in keys]
            t_get = [t for t, _ in timed_gets]
            got = [g for _, g in timed_gets]
            assert all(g is not None and len(g) == len(b) for g, b in zip(got, blobs, strict=True))
            decode_block(got[-1], layout)  # what came back is the stored block, checksum and all
            puts += t_put
            gets += t_get
            put_totals.append(sum(t_put))
            get_totals.append(sum(t_get))
        store.delete(keys)
    finally:
        store.close()
    nbytes = sum(len(b) for b in blobs)
    return (statistics.median(puts) * 1e3, statistics.median(gets) * 1e3,
            nbytes / statistics.median(put_totals) / 1e9, nbytes / statistics.median(get_totals) / 1e9)  # fmt: skip


def bench_r3(make: Callable[[bool], RoutingStore], rows: np.ndarray, layers: list[int], rounds: int,
             fused: bool) -> tuple[float, float, float, float]:  # fmt: skip
    """(put ms, get ms, put GB/s, get GB/s) of one request's R3 ([T, L, K]) stored fused or per layer."""
    store = make(fused)
    t_put, t_get = [], []
    try:
        for r in range(rounds):
            rid = f"bench:{r}:0:0"
            t_put.append(_timed(lambda rid=rid: store.put(rid, [rows], layers))[0])
            seconds, out = _timed(lambda rid=rid: store.get(rid, moe_layer_ids=None if fused else layers))
            t_get.append(seconds)
            assert np.array_equal(out, rows)
    finally:
        store.close()
    put_s, get_s = statistics.median(t_put), statistics.median(t_get)
    return put_s * 1e3, get_s * 1e3, rows.nbytes / put_s / 1e9, rows.nbytes / get_s / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    layout = BlockLayout(
        num_ranks=1, kv_shape=(args.layers, 2, args.block_size, args.kv_heads, args.head_dim), kv_dtype="bfloat16",
        kv_itemsize=2, rows_shape=(args.block_size, args.layers, args.top_k), rows_dtype="uint8",
    )  # fmt: skip
    rng = np.random.default_rng(0)
    num_blocks = args.tokens // args.block_size
    blobs = [
        encode_block(layout, [rng.integers(0, 256, layout.kv_nbytes, dtype=np.uint8)],
                     rng.integers(0, 128, layout.rows_shape, dtype=np.uint8))  # fmt: skip
        for _ in range(num_blocks)
    ]
    rows = rng.integers(0, 128, (args.tokens, args.layers, args.top_k), dtype=np.uint8)  # [T, L, K]
    layers = list(range(args.layers))
    kv_total = sum(len(b) for b in blobs)
    print(f"KV: {num_blocks} blocks of {len(blobs[0]) / 2**20:.2f} MiB ({kv_total / 2**20:.0f} MiB); "
          f"R3: [{args.tokens}, {args.layers}, {args.top_k}] uint8 = {rows.nbytes / 2**20:.2f} MiB; "
          f"{args.rounds} rounds")  # fmt: skip

    table = []
    with tempfile.TemporaryDirectory(prefix="fdr3_bench_") as tmp, \
            _servers(holder_bytes=kv_total + 512 * 2**20) as (redis_url, mc_url):
        from fastdeploy_r3.r3.stores.mooncake import MooncakeRoutingStore

        backends: dict[str, tuple[str, Callable[[bool], RoutingStore]]] = {
            "file": (f"file://{tmp}/kv", lambda fused: LocalRoutingStore(f"{tmp}/r3", use_fused_put=fused)),
            "redis": (redis_url, lambda fused: RedisRoutingStore(redis_url, "bench", use_fused_put=fused)),
            "mooncake": (mc_url, lambda fused: MooncakeRoutingStore(mc_url, "bench", use_fused_put=fused)),
        }
        for name, (kv_url, make_r3) in backends.items():
            table.append((name, f"KV block x{num_blocks}", *bench_kv(kv_url, blobs, layout, args.rounds)))
            table.append((name, "R3 fused", *bench_r3(make_r3, rows, layers, args.rounds, fused=True)))
            table.append((name, f"R3 per layer x{args.layers}", *bench_r3(make_r3, rows, layers, args.rounds, False)))

    print(f"{'store':<9} {'payload':<18} {'put ms':>9} {'get ms':>9} {'put GB/s':>9} {'get GB/s':>9}")
    for name, what, put_ms, get_ms, put_gbs, get_gbs in table:
        print(f"{name:<9} {what:<18} {put_ms:>9.2f} {get_ms:>9.2f} {put_gbs:>9.2f} {get_gbs:>9.2f}")
    print("KV ms are per block (median); R3 ms are per request (all its objects); GB/s over the request's bytes.")


if __name__ == "__main__":
    main()
