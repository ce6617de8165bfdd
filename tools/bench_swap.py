"""Bandwidth of the CacheTransferManager: swap GPU<->CPU and file-storage put/get, through the real subprocess.

    python tools/bench_swap.py [--blocks 64] [--repeats 5]

Per-block shape of the fake `small` model (8 layers, 4 KV heads, head dim 64, TP=1) with R3 rows of
8 MoE layers x top-8 (uint8). GB/s = bytes the CTM reports moved / seconds the CTM reports spent (the
best of the repeats), so pipe latency is not counted; "ack ms" is the engine-side round trip of one task.
On CPU the "GPU" tier is shared memory, so swap numbers are memcpy bandwidth, not PCIe; with
`--device cuda` it is a CUDA tensor shared with the CTM through CUDA IPC and the CPU tier is pinned.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

# tools/ is run as a script from a checkout where the package is not necessarily installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastdeploy_r3.cache_manager.cache_transfer_client import CacheTransferClient
from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer, RoutingBufferSpec
from fastdeploy_r3.cache_manager.shm import ShmSegment, new_engine_suffix, shm_name, unlink_all
from fastdeploy_r3.cache_manager.transfer import (
    CacheTransferConfig,
    KVCacheSpec,
    TransferKind,
    TransferTask,
)

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 8, 4, 64
MOE_LAYERS, TOP_K = 8, 8


def bench_one(
    block_size: int, dtype: torch.dtype, num_blocks: int, repeats: int, storage_dir: str, device: str = "cpu"
) -> dict[str, tuple]:
    suffix = new_engine_suffix()
    shape = (NUM_LAYERS, 2, 2 * num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    itemsize = torch.empty((), dtype=dtype).element_size()
    name = shm_name(suffix, "kv_gpu_rank0")
    seg, cuda_ipc = None, None
    if device == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        kv = torch.randn(shape, device="cuda").to(dtype)
        cuda_ipc = reduce_tensor(kv)
    else:
        seg = ShmSegment.create(name, int(np.prod(shape)) * itemsize)
        kv = seg.torch(shape, dtype)
        kv.copy_(torch.randn(shape).to(dtype))
    host_spec = RoutingBufferSpec(shm_name(suffix, "routing_host"), shape[2] * block_size, MOE_LAYERS, TOP_K, "uint8")
    host = RoutingBuffer.create(host_spec)
    host.tags[:] = 1  # every slot "computed", so GPU2STORAGE accepts the blocks
    config = CacheTransferConfig(
        kv_specs=[KVCacheSpec(name, shape, str(dtype).removeprefix("torch."), device=device, cuda_ipc=cuda_ipc)],
        num_cpu_blocks=num_blocks,
        block_size=block_size,
        routing_host=host_spec,
        routing_swap_name=shm_name(suffix, "routing_swap"),
        kv_cpu_name=shm_name(suffix, "kv_cpu"),
        storage_url=f"file://{storage_dir}",
        storage_namespace=f"bench-small-{block_size}-{dtype}",
        parent_pid=os.getpid(),
    )
    client = CacheTransferClient()
    client.start(config)
    gpu_ids = list(range(num_blocks))
    cpu_ids = list(range(num_blocks))
    keys = [f"{block_size:04x}{i:028x}" for i in range(num_blocks)]
    moved = [b + num_blocks for b in gpu_ids]  # swap-in / load into other GPU blocks than the source
    plans = {
        "SWAP2CPU": lambda tid: TransferTask(tid, TransferKind.SWAP2CPU, gpu_ids, cpu_block_ids=cpu_ids),
        "SWAP2GPU": lambda tid: TransferTask(tid, TransferKind.SWAP2GPU, moved, cpu_block_ids=cpu_ids),
        "file put": lambda tid: TransferTask(tid, TransferKind.GPU2STORAGE, gpu_ids, storage_keys=keys),
        "file get": lambda tid: TransferTask(
            tid, TransferKind.STORAGE2GPU, moved, storage_keys=keys, routing_tags=[2] * num_blocks
        ),
    }
    results: dict[str, tuple] = {}
    task_id = 0
    try:
        for label, plan in plans.items():
            best_gbs, best_ms = 0.0, float("inf")
            for _ in range(repeats):
                task_id += 1
                t0 = time.perf_counter()
                client.submit(plan(task_id))
                ack = client.wait(task_id, timeout=120)
                wall = time.perf_counter() - t0
                if not ack.ok:
                    raise RuntimeError(f"{label} failed: {ack.error}")
                best_gbs = max(best_gbs, ack.nbytes / ack.seconds / 1e9)
                best_ms = min(best_ms, wall * 1e3)
            results[label] = (best_gbs, best_ms)
    finally:
        client.shutdown()
        del kv
        host.close()
        if seg is not None:
            seg.close()
        unlink_all(suffix)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=64, help="blocks per task")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the GPU tier lives")
    args = ap.parse_args()
    print(f"fake `small` model: {NUM_LAYERS} layers x {NUM_KV_HEADS} kv heads x head dim {HEAD_DIM}, TP=1, "
          f"R3 {MOE_LAYERS}x{TOP_K} uint8; {args.blocks} blocks per task, best of {args.repeats}, "
          f"device {args.device}")  # fmt: skip
    header = f"{'dtype':>9} {'block':>5} {'KiB/blk':>8} | " + " | ".join(
        f"{k:>8} GB/s {'ack ms':>7}" for k in ("SWAP2CPU", "SWAP2GPU", "file put", "file get")
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory(prefix="fdr3_bench_") as storage_dir:
        for dtype in (torch.float32, torch.bfloat16):
            for block_size in (16, 32, 64):
                r = bench_one(block_size, dtype, args.blocks, args.repeats, storage_dir, args.device)
                kib = NUM_LAYERS * 2 * block_size * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize / 1024
                cells = " | ".join(f"{r[k][0]:>13.2f} {r[k][1]:>7.1f}" for k in r)
                print(f"{str(dtype).removeprefix('torch.'):>9} {block_size:>5} {kib:>8.0f} | {cells}", flush=True)


if __name__ == "__main__":
    main()
