"""End-to-end R3 check against a running fastdeploy_r3 server.

    python tools/test_r3_swap.py --api-url http://127.0.0.1:8000 [--log-dir DIR] [--api-key K]

Phases, each printing one PASS/FAIL line with its numbers (exit 1 on any FAIL):
  1 init     model, moe_layer_ids, routing dtype (from /v1/models)
  2 capture  one request's R3 is [P+N-1, L, K], dtype as announced, ids in [0, num_experts), K distinct per row
  3 swap     a long shared prefix survives eviction to the CPU tier and back: its rows are bit-exact across
             requests and /metrics shows swap-outs and swap-ins. Start the server with a tiny GPU cache and a
             CPU tier, e.g. --block-size 4 --num-gpu-blocks-override 24 --num-cpu-blocks-override 64
  4 store    in local / p2pstore mode: every choice's R3 is in the store under its rollout id (n=2 suffixes,
             TTL set in Redis, no temp files left), and a path-traversal rollout id is refused with 400
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import uuid

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastdeploy_r3.client import decode_routed_experts, read_local_rollout, read_redis_rollout  # noqa: E402
from fastdeploy_r3.r3.rollout_id import choice_rollout_id  # noqa: E402

TOKEN_LO, TOKEN_HI = 16, 250  # plain tokens in any real or fake vocabulary; clear of special tokens


class PhaseFailed(Exception):
    pass


class R3Checker:
    def __init__(
        self, api_url: str, api_key: str | None, log_dir: str | None, redis_url: str | None,
        local_store_dir: str | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.local_store_dir = local_store_dir  # the server does not publish its directory
        self.http = httpx.Client(base_url=api_url.rstrip("/"), headers=headers, timeout=600.0)
        self.log_dir = log_dir
        self.redis_url = redis_url
        self.run_id = uuid.uuid4().hex[:8]
        self.rng = np.random.default_rng(0)
        self.model = ""
        self.r3: dict = {}
        self.failed = 0

    # -- helpers ----------------------------------------------------------------------------------

    def log(self, name: str, obj: object) -> None:
        if not self.log_dir:
            return
        os.makedirs(self.log_dir, exist_ok=True)
        path = os.path.join(self.log_dir, name)
        if isinstance(obj, np.ndarray):
            np.save(path, obj)
        else:
            with open(path, "w") as f:
                json.dump(obj, f, indent=1, default=str)

    def tokens(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(TOKEN_LO, TOKEN_HI, size=n)]

    def complete(self, prompt: list[int], max_tokens: int, rollout_id: str, n: int = 1) -> dict:
        body = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "n": n,
            "ignore_eos": True, "rollout_id": rollout_id,
        }
        r = self.http.post("/v1/completions", json=body)
        if r.status_code != 200:
            raise PhaseFailed(f"/v1/completions answered {r.status_code}: {r.text[:500]}")
        return r.json()

    def routed_experts(self, resp: dict, rollout_id: str, index: int = 0) -> np.ndarray:
        """R3 of one choice, from the response or, in store modes, from the store."""
        choice = sorted(resp["choices"], key=lambda c: c["index"])[index]
        if choice.get("routed_experts"):
            return decode_routed_experts(choice["routed_experts"])
        n = len(resp["choices"])
        sel = None if n == 1 else index
        layers = None if self.r3.get("use_fused_put", True) else self.r3["moe_layer_ids"]
        store = self.r3.get("routing_store_type")
        if store == "local":
            return read_local_rollout(self.local_store_dir_or_fail(), rollout_id, choice=sel, moe_layer_ids=layers)
        if store == "p2pstore":
            return read_redis_rollout(self.redis_url_or_fail(), self.r3["namespace"], rollout_id, sel, layers)
        raise PhaseFailed(f"choice {index} of {resp.get('id')} carries no routed_experts (store type {store!r})")

    def local_store_dir_or_fail(self) -> str:
        if not self.local_store_dir:
            raise PhaseFailed("the server stores R3 in a local directory it does not publish; pass --local-store-dir")
        return self.local_store_dir

    def redis_url_or_fail(self) -> str:
        url = self.redis_url or self.r3.get("p2pstore_url")
        if not url or "***" in url:
            raise PhaseFailed("the server's p2pstore URL has a password; pass --redis-url")
        return url

    def metrics(self) -> dict[str, float]:
        r = self.http.get("/metrics")
        r.raise_for_status()
        out = {}
        for line in r.text.splitlines():
            m = re.fullmatch(r"fastdeploy_r3_engine_(\w+?)(?:_total)? ([-+.eE0-9]+|NaN)", line.strip())
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def check_rows(self, arr: np.ndarray, rows: int, what: str) -> None:
        L, K = len(self.r3["moe_layer_ids"]), self.r3["moe_top_k"]
        if arr.shape != (rows, L, K):
            raise PhaseFailed(f"{what}: R3 shape {arr.shape}, expected {(rows, L, K)}")
        if str(arr.dtype) != self.r3["routing_dtype"]:
            raise PhaseFailed(f"{what}: R3 dtype {arr.dtype}, the server announced {self.r3['routing_dtype']}")
        if arr.size and int(arr.max()) >= self.r3["num_experts"]:
            bad = np.argwhere(arr >= self.r3["num_experts"])[0]
            raise PhaseFailed(f"{what}: row {bad[0]} layer {bad[1]} holds expert {arr[tuple(bad)]} "
                              f">= num_experts {self.r3['num_experts']}")
        srt = np.sort(arr.astype(np.int64), axis=-1)
        dup = np.argwhere((srt[..., 1:] == srt[..., :-1]).any(axis=-1))
        if len(dup):
            raise PhaseFailed(f"{what}: row {dup[0][0]} layer {dup[0][1]} repeats an expert: {arr[tuple(dup[0])]}")

    # -- phases -----------------------------------------------------------------------------------

    def phase_init(self) -> str:
        r = self.http.get("/v1/models")
        if r.status_code != 200:
            raise PhaseFailed(f"/v1/models answered {r.status_code}: {r.text[:300]}")
        card = r.json()["data"][0]
        self.model, self.r3 = card["id"], card.get("r3") or {}
        if not self.r3.get("enabled"):
            raise PhaseFailed(f"model {self.model!r}: routing replay is off; start the server with "
                              "--routing-replay-config '{\"enable_routing_replay\": true}'")
        self.log("models.json", card)
        return (f"model={self.model} moe_layer_ids={self.r3['moe_layer_ids']} dtype={self.r3['routing_dtype']} "
                f"num_experts={self.r3['num_experts']} top_k={self.r3['moe_top_k']} "
                f"store={self.r3['routing_store_type']}")

    def phase_capture(self) -> str:
        prompt, n_new = self.tokens(13), 6
        rid = f"r3swap-{self.run_id}-capture"
        resp = self.complete(prompt, n_new, rid)
        p, n = resp["usage"]["prompt_tokens"], resp["usage"]["completion_tokens"]
        if (p, n) != (len(prompt), n_new):
            raise PhaseFailed(f"usage says P={p} N={n}, sent P={len(prompt)} and asked N={n_new} with ignore_eos")
        arr = self.routed_experts(resp, rid)
        self.check_rows(arr, p + n - 1, "capture")
        self.log("capture.npy", arr)
        return f"shape={list(arr.shape)} = [P+N-1={p}+{n}-1, L, K] ids in [0, {self.r3['num_experts']})"

    def phase_swap(self) -> str:
        before = self.metrics()
        bs = int(self.r3.get("block_size") or 16)
        gpu_blocks = int(before.get("num_gpu_blocks", 0))
        cpu_blocks = int(before.get("num_cpu_blocks", 0))
        if cpu_blocks <= 0:
            raise PhaseFailed("the server has no CPU tier (num_cpu_blocks=0); start it with --swap-space or "
                              "--num-cpu-blocks-override")
        if gpu_blocks * bs > 16384:
            raise PhaseFailed(f"the GPU cache holds {gpu_blocks} blocks x {bs} tokens: too many to force swaps; "
                              "start the server with e.g. --block-size 4 --num-gpu-blocks-override 24")
        # a shared prefix of ~1/3 of the GPU cache; floods of ~2/3 each push it out to the CPU tier
        prefix_len = max(2, gpu_blocks // 3) * bs
        flood_len = max(2, (2 * gpu_blocks) // 3 - 2) * bs
        max_new = 3
        prefix = self.tokens(prefix_len)
        arrays, cached = [], []
        for i in range(3):
            rid = f"r3swap-{self.run_id}-swap{i}"
            resp = self.complete(prefix + self.tokens(3 + i), max_new, rid)
            arr = self.routed_experts(resp, rid)
            self.check_rows(arr, resp["usage"]["prompt_tokens"] + resp["usage"]["completion_tokens"] - 1, f"swap {i}")
            arrays.append(arr)
            cached.append((resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0))
            self.log(f"swap{i}.npy", arr)
            for j in range(2):  # evict the prefix from the GPU cache
                self.complete(self.tokens(flood_len), 1, f"r3swap-{self.run_id}-flood{i}-{j}")
        after = self.metrics()
        out_d = after.get("swap_out_blocks", 0) - before.get("swap_out_blocks", 0)
        in_d = after.get("swap_in_blocks", 0) - before.get("swap_in_blocks", 0)
        mismatch = [i for i in (1, 2) if not np.array_equal(arrays[i][:prefix_len], arrays[0][:prefix_len])]
        self.log("swap.json", {"prefix_len": prefix_len, "flood_len": flood_len, "cached_tokens": cached,
                               "swap_out_delta": out_d, "swap_in_delta": in_d, "mismatch": mismatch})
        numbers = (f"prefix={prefix_len} tokens ({prefix_len // bs} blocks of {bs}), gpu_blocks={gpu_blocks} "
                   f"cpu_blocks={cpu_blocks}, swap_out +{out_d:.0f} swap_in +{in_d:.0f} blocks, "
                   f"cached_tokens={cached}")
        if mismatch:
            i = mismatch[0]
            row = int(np.argwhere((arrays[i][:prefix_len] != arrays[0][:prefix_len]).any(axis=(1, 2)))[0][0])
            raise PhaseFailed(f"{numbers}; request {i}'s shared-prefix rows differ from request 0's at row {row}")
        if out_d <= 0 or in_d <= 0:
            raise PhaseFailed(f"{numbers}; expected both swap-outs and swap-ins to happen")
        return f"{numbers}; shared-prefix rows bit-exact across 3 requests"

    def phase_store(self) -> str:
        store = self.r3.get("routing_store_type")
        if store not in ("local", "p2pstore"):
            return f"not applicable: routing_store_type={store!r} (R3 travelled in responses, checked above)"
        rid = f"r3swap-{self.run_id}-store"
        prompt, n_new = self.tokens(9), 4
        resp = self.complete(prompt, n_new, rid, n=2)
        if any(c.get("routed_experts") for c in resp["choices"]):
            raise PhaseFailed(f"{store} mode but the response carries routed_experts")
        rows = len(prompt) + n_new - 1
        for i in range(2):
            self.check_rows(self.routed_experts(resp, rid, i), rows, f"store choice {i}")
        details = []
        if store == "p2pstore":
            import redis

            client = redis.Redis.from_url(self.redis_url_or_fail())
            key = f"{self.r3['namespace']}/{choice_rollout_id(rid, 0)}"
            if not self.r3.get("use_fused_put", True):
                key += f"/layer_{self.r3['moe_layer_ids'][0]}"
            ttl = client.ttl(key)
            client.close()
            if ttl <= 0:
                raise PhaseFailed(f"key {key} has TTL {ttl}; every R3 key must expire")
            details.append(f"key {key} ttl={ttl}s")
        else:
            store_dir = self.local_store_dir_or_fail()
            leftovers = [n for n in os.listdir(store_dir) if ".tmp." in n]
            if leftovers:
                raise PhaseFailed(f"temp files left in {store_dir}: {leftovers[:3]}")
            details.append(f"files under {store_dir}")
        bad = self.http.post("/v1/completions", json={"model": self.model, "prompt": prompt, "max_tokens": 1,
                                                      "rollout_id": "../escape"})
        if bad.status_code != 400:
            raise PhaseFailed(f"rollout_id '../escape' answered {bad.status_code}, expected 400")
        stored = f"choices {choice_rollout_id(rid, 0)}/#1 stored with shape [{rows}, L, K]"
        return f"{store}: {stored}; {', '.join(details)}; '../' -> 400"

    def run(self) -> int:
        phases = [("1 init", self.phase_init), ("2 capture", self.phase_capture), ("3 swap", self.phase_swap),
                  ("4 store", self.phase_store)]
        for name, fn in phases:
            try:
                print(f"PASS phase {name}: {fn()}", flush=True)
            except (PhaseFailed, httpx.HTTPError, KeyError, ValueError, OSError) as e:
                self.failed += 1
                print(f"FAIL phase {name}: {type(e).__name__}: {e}", flush=True)
                if name == "1 init":
                    break  # nothing else can run without the model facts
        return 1 if self.failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--api-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--log-dir", default=None, help="write the R3 arrays and per-phase numbers here")
    p.add_argument("--api-key", default=os.environ.get("FDR3_API_KEY"))
    p.add_argument("--redis-url", default=None, help="p2pstore URL when the server's has a password")
    p.add_argument("--local-store-dir", default=None, help="the server's local_store_dir, in local store mode")
    args = p.parse_args(argv)
    return R3Checker(args.api_url, args.api_key, args.log_dir, args.redis_url, args.local_store_dir).run()


if __name__ == "__main__":
    sys.exit(main())
