"""A small RL loop against a fastdeploy_r3 server, driven the way RL frameworks drive SGLang.

    python examples/rl_loop.py --model DIR [--url http://127.0.0.1:8000] [--steps 3]

Without --url the script starts a server on a free loopback port (R3 on, CPU) and stops it at the end.
The "trainer" is this project's own model code in float32 on the CPU. Each step:

  1. rollouts   POST /generate with input_ids, return_logprob and return_routed_experts; the answer is
                decoded exactly as slime decodes it: tokens from output_token_logprobs, R3 as raw int32
                reshaped to (len(tokens) - 1, num_hidden_layers, top_k)
  2. replay     the trainer's forward over tokens[:-1] with the engine's experts forced on every MoE
                layer (RoutingReplay); it must reproduce the engine's greedy tokens, and its logprobs
                when the engine returns them (|diff| < 1e-4)
  3. update     a policy-gradient step through the replayed routing (toy reward: even token ids) and a
                small seeded nudge of the routers so the routing visibly moves; pushed with
                /init_weights_update_group + /update_weights_from_distributed (gloo), new weight_version
  4. the next step's rollouts must carry that weight_version and agree with the trainer's new weights

Prints one line per step; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastdeploy_r3.client.weight_sync import WeightSync  # noqa: E402
from fastdeploy_r3.config import ModelConfig  # noqa: E402
from fastdeploy_r3.model_executor.forward_context import ForwardContext, RoutingReplay, set_forward_context  # noqa: E402
from fastdeploy_r3.model_executor.layers.moe import SparseMoeBlock  # noqa: E402
from fastdeploy_r3.model_executor.model_loader import load_model  # noqa: E402

PROMPTS = ["The quick brown fox", "Tell me a story about a cat", "What is the capital of France?", "def main():"]
LOGPROB_TOLERANCE = 1e-4


@dataclass
class Sample:
    tokens: list[int]  # prompt + completion
    num_prompt_tokens: int
    logprobs: list[float | None]  # per completion token, as the engine reported them
    routed_experts: np.ndarray  # [len(tokens) - 1, num_hidden_layers, K] int32
    weight_version: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(model: str, timeout_s: float = 120.0) -> Iterator[str]:
    port = free_port()
    r3 = json.dumps({"enable_routing_replay": True})
    cmd = [sys.executable, "-m", "fastdeploy_r3.entrypoints.openai.api_server", "--model", model, "--port", str(port),
           "--device", "cpu", "--max-model-len", "256", "--routing-replay-config", r3, "--log-level", "warning"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} during start-up")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not healthy within {timeout_s} s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def rollout(url: str, prompts: list[list[int]], max_new_tokens: int, num_layers: int, top_k: int) -> list[Sample]:
    body = {
        "input_ids": prompts,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        "return_logprob": True,
        "return_routed_experts": True,
    }
    resp = httpx.post(f"{url}/generate", json=body, timeout=300)
    resp.raise_for_status()
    samples = []
    for prompt, out in zip(prompts, resp.json()):
        meta = out["meta_info"]
        completion = [item[1] for item in meta["output_token_logprobs"]]  # slime: [logprob, token_id, text]
        tokens = prompt + completion
        rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
        samples.append(Sample(tokens, len(prompt), [item[0] for item in meta["output_token_logprobs"]],
                              rows.reshape(len(tokens) - 1, num_layers, top_k), meta["weight_version"]))
    return samples


class _Recorder:
    """Collects the experts the trainer's own routers choose (no replay), per MoE layer."""

    def __init__(self, num_moe_layers: int) -> None:
        self.ids: list[torch.Tensor] = [torch.empty(0)] * num_moe_layers

    def capture(self, moe_index: int, topk_ids: torch.Tensor) -> None:
        self.ids[moe_index] = topk_ids.detach().clone()


def forward(model: torch.nn.Module, tokens: list[int], replay: np.ndarray | None) -> tuple[torch.Tensor, _Recorder]:
    """Logits [T-1, V] of tokens[:-1]; replay [T-1, L, K] forces the MoE layers' experts."""
    ids = torch.tensor(tokens[:-1], dtype=torch.int64)
    recorder = _Recorder(len(model.moe_layer_ids))
    forced = None if replay is None else RoutingReplay(torch.from_numpy(replay.astype(np.int64)))
    with set_forward_context(ForwardContext(None, [], recorder, routing_replay=forced)):
        return model.compute_logits(model(ids, torch.arange(len(ids)))), recorder


def check_replay(model: torch.nn.Module, s: Sample) -> tuple[bool, float | None, int, torch.Tensor]:
    """(greedy tokens reproduced, max |logprob diff| or None, rows the free router disagrees on, logprobs)."""
    moe_rows = s.routed_experts[:, model.moe_layer_ids, :]  # [T-1, L, K]
    logits, _ = forward(model, s.tokens, moe_rows)
    p = s.num_prompt_tokens
    completion = torch.tensor(s.tokens[p:])
    logprobs = torch.log_softmax(logits[p - 1 :], dim=-1).gather(1, completion[:, None])[:, 0]  # [N]
    same_tokens = torch.equal(logits[p - 1 :].argmax(dim=-1), completion)
    reported = [lp for lp in s.logprobs if lp is not None]
    diff = None
    if len(reported) == len(s.logprobs):
        diff = float((logprobs.detach() - torch.tensor(reported, dtype=torch.float32)).abs().max())
    with torch.no_grad():
        _, free = forward(model, s.tokens, None)
    chosen = torch.stack(free.ids, dim=1).sort(dim=-1).values  # [T-1, L, K]
    recorded = torch.from_numpy(moe_rows.astype(np.int64)).sort(dim=-1).values
    disagree = int((chosen != recorded).any(dim=-1).any(dim=-1).sum())
    return same_tokens, diff, disagree, logprobs


def train_step(model: torch.nn.Module, samples: list[Sample], logprobs: list[torch.Tensor], step: int,
               lr: float) -> None:
    """One policy-gradient step through the replayed routing (logprobs [N] per sample, with their
    graph), then a seeded nudge of the routers."""
    rewards = torch.tensor([np.mean([t % 2 == 0 for t in s.tokens[s.num_prompt_tokens:]]) for s in samples])
    advantages = rewards - rewards.mean()
    loss = -sum(adv * lp.sum() for adv, lp in zip(advantages, logprobs)) / len(samples)
    model.zero_grad()
    loss.backward()
    gen = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                param -= lr * param.grad
        for block in model.modules():
            if isinstance(block, SparseMoeBlock):
                weight = block.gate.weight
                weight += 0.05 * torch.randn(weight.shape, generator=gen).to(weight.dtype)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the model directory the server serves")
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    torch.set_num_threads(1)  # the server's worker computes on this machine too
    model = load_model(ModelConfig(model=args.model), torch.device("cpu"))
    model.requires_grad_(True)

    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(local_server(args.model))
        print(f"server ready after {time.perf_counter() - t0:.1f} s", flush=True)
        info = httpx.get(f"{url}/get_model_info", timeout=30).json()
        num_layers, top_k = info["num_hidden_layers"], info["moe_top_k"]
        sync = WeightSync(url)
        stack.callback(sync.close)
        sync.init_group(master_port=free_port(), backend="gloo")
        ok, previous, version = True, None, sync.weight_version()
        for step in range(args.steps + 1):
            t_step = time.perf_counter()
            samples = rollout(url, prompts, args.max_new_tokens, num_layers, top_k)
            t_replay = time.perf_counter()
            results = [check_replay(model, s) for s in samples]
            tokens_ok = all(r[0] for r in results)
            diffs = [r[1] for r in results if r[1] is not None]
            logprobs_ok = all(d < LOGPROB_TOLERANCE for d in diffs)
            versions_ok = all(s.weight_version == version for s in samples)
            moved = None if previous is None else sum(
                int((a.routed_experts != b.routed_experts).any(axis=(1, 2)).sum()) for a, b in zip(samples, previous)
            )
            ok = ok and tokens_ok and logprobs_ok and versions_ok
            print(
                f"step {step}: weight_version {version} ({'ok' if versions_ok else 'MISMATCH'}), "
                f"{len(samples)} rollouts, replayed greedy tokens {'equal' if tokens_ok else 'DIFFER'}, "
                f"max |logprob diff| {max(diffs) if diffs else 'n/a (no logprobs returned)'}, "
                f"free-router rows that differ from R3 {sum(r[2] for r in results)}, "
                f"R3 rows changed since last step {moved if moved is not None else '-'}",
                flush=True,
            )
            if step == args.steps:
                break
            t_train = time.perf_counter()
            train_step(model, samples, [r[3] for r in results], step, args.lr)
            version = str(int(version) + 1) if version.isdigit() else f"{version}.{step + 1}"
            t_push = time.perf_counter()
            sync.push(model.checkpoint_weights(), weight_version=version)
            print(f"  rollout {t_replay - t_step:.1f} s, replay {t_train - t_replay:.1f} s, "
                  f"train {t_push - t_train:.1f} s, "
                  f"push {time.perf_counter() - t_push:.1f} s", flush=True)
            if sync.weight_version() != version:
                print(f"the server reports weight_version {sync.weight_version()}, pushed {version}", flush=True)
                ok = False
            previous = samples
    print("rl_loop: OK" if ok else "rl_loop: FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
