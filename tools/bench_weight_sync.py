"""Seconds to push a model's full weights into a running server, the two ways RL trainers do it, and
to release and resume its memory (colocated training):

    update_weights_from_tensor         the trainer (this process, same device) hands its tensors by
                                       reference: CUDA IPC handles (shared-memory files on the CPU)
    update_weights_from_distributed    the trainer broadcasts every tensor over a group it shares with
                                       the engine's workers: NCCL on CUDA (two ranks on one GPU need an
                                       NCCL that allows it; else gloo, reported as such), gloo on the CPU
    release + resume memory            KV cache and weights freed, allocated again (then weights pushed)

    python tools/bench_weight_sync.py --preset qwen3-30b-a3b --device cuda --png weight_sync.png
    python tools/bench_weight_sync.py --device cpu        # the fake tiny model (what the CPU test runs)

Prints a table (seconds, GB/s of weight bytes) and writes a PNG and a JSON of the rows. The server is
the real API server in a subprocess; the trainer holds a second copy of the weights (different seed)
so that every push changes every parameter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TOOLS_DIR)
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, TOOLS_DIR)
sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))  # the process launchers the tests use

import httpx  # noqa: E402
from api_server_process import api_server, free_port  # noqa: E402
from model_presets import add_model_args, bench_model  # noqa: E402


def server_args(args: argparse.Namespace) -> list[str]:
    # the launcher passes --device cpu first; the last --device wins
    return ["--device", args.device, "--dtype", args.dtype, "--load-format", args.load_format,
            "--num-gpu-blocks-override", str(args.num_gpu_blocks), "--max-model-len", str(args.max_model_len),
            "--worker-step-timeout-s", "600", "--engine-stall-timeout-s", "900"]


def trainer_weights(model_dir: str, args: argparse.Namespace) -> tuple[Any, list[tuple[str, Any]]]:
    """The trainer's copy: the same architecture with other random weights, on this process's device."""
    import torch

    from fastdeploy_r3.config import ModelConfig
    from fastdeploy_r3.model_executor.model_loader import load_model

    mc = ModelConfig(model=model_dir, dtype=args.dtype, load_format="dummy", seed=args.seed + 1)
    model = load_model(mc, torch.device(args.device))
    return model, list(model.checkpoint_weights())


_HTTP: httpx.Client | None = None


def post(url: str, path: str, body: dict) -> dict:
    global _HTTP
    if _HTTP is None:
        from fastdeploy_r3.client.weight_sync import http_client

        _HTTP = http_client(3600)  # one keep-alive connection, Nagle off, as a trainer's client should be
    r = _HTTP.post(f"{url}{path}", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:500]}")
    return r.json()


def progress(msg: str) -> None:
    """One line per phase on stderr, flushed: a run cut short by a time limit still says how far it got."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def push_from_tensor(url: str, items: list[tuple[str, Any]], bucket_bytes: int, version: str,
                     load_format: str = "direct") -> float:
    """Seconds for every bucket of `items` to be loaded. "direct": every tensor its own handle (views, no
    copy on this side); "flattened_bucket": each bucket copied into one buffer first (one handle per
    bucket, what slime sends when it can), the copy counted in the time."""
    import torch

    from fastdeploy_r3.client.tensor_transport import flattened_bucket, serialize, serialize_named_tensors

    buckets, cur, size = [], [], 0
    for name, t in items:
        cur.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    start = time.perf_counter()
    for i, bucket in enumerate(buckets):
        if load_format == "flattened_bucket":
            payload = serialize(flattened_bucket(bucket))
        else:
            payload = serialize_named_tensors(bucket)
        body = {"serialized_named_tensors": [payload], "weight_version": version}
        if load_format != "direct":
            body["load_format"] = load_format
        post(url, "/update_weights_from_tensor", body)
        if i % 8 == 7:
            progress(f"  {load_format}: {i + 1}/{len(buckets)} buckets, {time.perf_counter() - start:.1f} s")
    elapsed = time.perf_counter() - start
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
    return elapsed


def push_from_distributed(url: str, items: list[tuple[str, Any]], backend: str, version: str) -> float:
    from fastdeploy_r3.client.weight_sync import WeightSync

    sync = WeightSync(url, timeout_s=3600)
    try:
        sync.init_group(master_port=free_port(), backend=backend)
        start = time.perf_counter()
        sync.push(items, weight_version=version)
        return time.perf_counter() - start
    finally:
        sync.close()


def timed(url: str, path: str, body: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    answer = post(url, path, body)
    return time.perf_counter() - start, answer


def run(args: argparse.Namespace, model_dir: str, log_dir: str) -> dict:
    progress("building the trainer's copy of the weights")
    model, items = trainer_weights(model_dir, args)
    progress(f"trainer ready: {len(items)} tensors")
    nbytes = sum(t.numel() * t.element_size() for _, t in items)
    rows: list[dict] = []

    def row(op: str, seconds: float, note: str = "", moved: int = nbytes) -> None:
        rows.append({"op": op, "seconds": seconds, "gb_per_s": moved / seconds / 1e9 if moved else None,
                     "note": note})

    with api_server(model_dir, log_dir, *server_args(args), timeout=args.start_timeout) as server:
        url = server.url
        progress("server ready")
        for fmt in args.tensor_formats.split(","):
            for i in range(args.repeats):
                row(f"update_weights_from_tensor ({fmt})",
                    push_from_tensor(url, items, args.bucket_mb << 20, f"tensor-{fmt}-{i}", fmt),
                    f"buckets of {args.bucket_mb} MiB")
                progress(f"row: {rows[-1]}")
        backends, dist_items = ["gloo"], items
        if args.device == "cuda":
            import torch

            if torch.cuda.device_count() < 2:
                # seen on the H200 (NCCL 2.28): ncclInvalidUsage for two ranks of one communicator on one GPU,
                # and the trainer's side of the half-made communicator never returns. One GPU times the path
                # over gloo instead, which stages CUDA tensors through host memory
                rows.append({"op": "update_weights_from_distributed (nccl)", "seconds": None, "gb_per_s": None,
                             "note": "not measured: NCCL refuses two ranks on one GPU; needs a second GPU"})
            else:
                backends = ["nccl"]
                dist_items = [(n, t.to("cuda:1")) for n, t in items]  # the trainer's copy on the other GPU
                torch.cuda.set_device(1)  # the trainer's NCCL rank lives there
        for backend in backends:
            try:
                seconds = push_from_distributed(url, dist_items, backend, f"dist-{backend}")
            except Exception as e:  # noqa: BLE001 - e.g. NCCL refusing two ranks on one GPU: say so, go on
                rows.append({"op": f"update_weights_from_distributed ({backend})", "seconds": None,
                             "gb_per_s": None, "note": f"failed: {type(e).__name__}: {str(e)[:120]}"})
                continue
            staged = ", CUDA tensors staged through host" if backend == "gloo" and args.device == "cuda" else ""
            row(f"update_weights_from_distributed ({backend})", seconds, "trainer = group rank 0" + staged)
            progress(f"row: {rows[-1]}")
            break
        seconds, answer = timed(url, "/release_memory_occupation", {"tags": None})
        freed = sum(r["bytes"] for r in answer.get("ranks", []))
        row("release_memory_occupation", seconds, f"{freed / 2**30:.2f} GiB freed (kv_cache + weights)", 0)
        seconds, answer = timed(url, "/resume_memory_occupation", {"tags": None})
        row("resume_memory_occupation", seconds, "allocation only: weights pushed next", 0)
        progress(f"released and resumed: {rows[-2:]}")
        fmt = args.tensor_formats.split(",")[-1]
        row(f"update_weights_from_tensor ({fmt}) after resume",
            push_from_tensor(url, items, args.bucket_mb << 20, "resumed", fmt))
        out = post(url, "/generate", {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 2,
                                                                                  "ignore_eos": True}})
        assert len(out["output_ids"]) == 2, out  # the server serves the pushed weights
    del model
    return {"weight_bytes": nbytes, "num_tensors": len(items), "rows": rows}


def print_table(res: dict, title: str) -> None:
    print(f"\n{title}: {res['num_tensors']} tensors, {res['weight_bytes'] / 1e9:.2f} GB\n")
    print("| operation | seconds | GB/s | note |")
    print("| --- | --- | --- | --- |")
    for r in res["rows"]:
        s = "-" if r["seconds"] is None else f"{r['seconds']:.3f}"
        g = "-" if r["gb_per_s"] is None else f"{r['gb_per_s']:.1f}"
        print(f"| {r['op']} | {s} | {g} | {r['note']} |")


def plot(res: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if r["seconds"] is not None]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.5))
    ax.barh([r["op"] for r in rows], [r["seconds"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax.text(r["seconds"], i, f" {r['seconds']:.2f} s", va="center")
    ax.set(xlabel="seconds", title=title)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--bucket-mb", type=int, default=1024, help="bytes of tensors per /update_weights_from_tensor")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tensor-formats", default="direct,flattened_bucket",
                    help="load formats of /update_weights_from_tensor to time, comma-separated")
    ap.add_argument("--num-gpu-blocks", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=1200)
    ap.add_argument("--work-dir", default=None, help="keep the model and the server logs here (default: a temp dir)")
    ap.add_argument("--png", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.work_dir:  # the server's logs outlive the run
            os.makedirs(args.work_dir, exist_ok=True)
            tmp = args.work_dir
        model_dir, args.load_format, title = bench_model(args, os.path.join(tmp, "model"))
        title += f", {args.dtype}, {args.device}"
        res = run(args, model_dir, tmp)
    print_table(res, title)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.png:
        plot(res, args.png, title)


if __name__ == "__main__":
    main()
