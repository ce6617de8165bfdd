"""Train/infer mismatch: the engine samples rollouts, the trainer (an HF transformers bf16 forward of the same
checkpoint) scores them, with and without the engine's routing replayed through R3.

    python tools/mismatch.py --model DIR [--prompts 4] [--rollouts 2] [--max-tokens 16]
        [--settings bf16,bf16-det,fp8,fp8-det] [--png mismatch.png] [--json mismatch.json]
        [--preset qwen3-30b-a3b --layers 8]

With --preset, DIR is first written: the preset's config and tokenizer, and weights that transformers
initialises and saves itself (a real-shape HF oracle without downloading a checkpoint).

DIR is a Hugging Face checkpoint the installed transformers loads (e.g. one tests/hf_checkpoints.py writes
with save_pretrained). Per engine setting (dtype bfloat16; --quantization fp8 or not; deterministic mode
on or off) the engine samples --rollouts completions of each prompt (temperature 1, no truncation, seeded,
R3 on), keeping each sampled token's logprob (= log p_engine: fastdeploy_r3/logprobs.py, T = 1) and its R3
rows [rows, L, K]. The trainer then runs the whole sequence once per view:

    no replay   HF routes by itself; its top-k set of each (token, MoE layer) is compared with R3's
    replay      every MoE layer's router output is patched to the R3 ids (weights: the router's own
                probabilities of those ids, normalised as the model does), slime's R3 replay

and reports, over the sampled tokens, mean |p_engine - p_train|, the k3 estimate of KL(engine || train)
(mean of r - 1 - log r, r = p_train / p_engine) and the fraction of (token, layer) top-k sets that differ
(0 under replay by construction: the tool checks the patched forward used exactly the R3 ids). Prints a
table and, with --png, plots both views per setting.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastdeploy_r3 import LLM, SamplingParams  # noqa: E402

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village",
    "The mixture of experts layer routes each token to",
    "2 + 2 * 3 =",
    "Reinforcement learning from human feedback",
)


@dataclass(frozen=True)
class EngineSetting:
    name: str
    quantization: str  # "none" or "fp8"
    deterministic: bool


SETTINGS = {
    s.name: s for s in (EngineSetting("bf16", "none", False), EngineSetting("bf16-det", "none", True),
                        EngineSetting("fp8", "fp8", False), EngineSetting("fp8-det", "fp8", True))
}  # fmt: skip


@dataclass(frozen=True)
class Rollout:
    prompt_ids: list[int]
    token_ids: list[int]  # the sampled completion, C tokens
    logprobs: np.ndarray  # [C] float64, log p_engine of each sampled token
    routed_experts: np.ndarray  # [P + C - 1, L, K] R3 rows: every forwarded position


@dataclass(frozen=True)
class Mismatch:
    setting: str
    tokens: int  # sampled tokens scored
    mean_abs_dp: float  # mean |p_engine - p_train|, trainer routing by itself
    k3: float
    topk_differ: float  # fraction of (token, MoE layer) top-k sets that differ from R3's
    replay_mean_abs_dp: float  # the same with the R3 ids replayed into the trainer
    replay_k3: float
    replay_topk_differ: float


def sample_rollouts(model: str, setting: EngineSetting, prompts: Sequence[str], rollouts: int, max_tokens: int,
                    seed: int = 0, device: str = "auto") -> list[Rollout]:  # fmt: skip
    """--rollouts sampled completions of every prompt, with their logprobs and R3 rows."""
    params = [SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=seed + i, max_tokens=max_tokens,
                             logprobs=0, ignore_eos=True) for i in range(rollouts)]  # fmt: skip
    with LLM(model, device=device, dtype="bfloat16", quantization=setting.quantization, block_size=4,
             enable_deterministic_inference=setting.deterministic,
             routing_replay_config={"enable_routing_replay": True, "debug_mode": False}) as llm:  # fmt: skip
        outs = llm.generate([p for p in prompts for _ in params], list(params) * len(prompts), use_tqdm=False)
    got = []
    for out in outs:
        c = out.outputs[0]
        assert c.logprobs is not None and c.routed_experts is not None and out.prompt_token_ids is not None
        if c.routed_experts_start != 0:
            raise RuntimeError(f"{out.request_id}: R3 rows start at {c.routed_experts_start}; the tool needs the "
                               "rows of the whole sequence (routing_replay_config without a prompt cut)")
        got.append(Rollout(list(out.prompt_token_ids), list(c.token_ids),
                           np.array([lp.logprob for lp in c.logprobs], dtype=np.float64), c.routed_experts))
    return got


class Trainer:
    """The trainer's view: the HF transformers model of the same checkpoint in bf16, its MoE routers hooked.

    transformers >= 5 gives every MoE block of Qwen3-MoE, Mixtral and GLM-4.5 a `gate` returning
    (router_logits, topk_weights, topk_ids) that the block passes on to its experts; the hook records those
    ids, or replaces them (and their weights) with the R3 ids of the same layer."""

    def __init__(self, model: str, device: str = "cpu") -> None:
        import transformers

        self.device = torch.device(device)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(self.device)
        self.model.eval()
        self.config = self.model.config
        self.gates = [m.gate for m in self.model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
        if not self.gates:
            raise ValueError(f"{model}: no MoE block with a `gate` router found in the transformers model")

    def replay_weights(self, router_logits: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weights the model's router gives forced ids [T, K] (as the engine's replay_weights does)."""
        cfg = self.config
        if cfg.model_type == "glm4_moe":
            w = router_logits.float().sigmoid().gather(1, ids)  # [T, K], un-biased scores
            if cfg.norm_topk_prob:
                w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
            return (w * cfg.routed_scaling_factor).to(dtype)
        w = torch.softmax(router_logits.float(), dim=-1).gather(1, ids)  # [T, K]
        if cfg.model_type == "mixtral" or getattr(cfg, "norm_topk_prob", False):
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(dtype)

    @contextmanager
    def _routing(self, replay: np.ndarray | None, used: list[torch.Tensor]) -> Iterator[None]:
        """Inside: each gate's ids go to `used` (one [T, K] per MoE layer); replay [T, L, K]: forced first."""

        def hook(index: int):  # noqa: ANN202
            def patch(_module, _args, output):  # noqa: ANN001, ANN202
                logits, weights, ids = output
                if replay is not None:
                    ids = torch.as_tensor(replay[:, index], dtype=torch.int64, device=logits.device)  # [T, K]
                    weights = self.replay_weights(logits, ids, weights.dtype)
                used.append(ids)
                return logits, weights, ids

            return patch

        handles = [g.register_forward_hook(hook(i)) for i, g in enumerate(self.gates)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def score(self, rollout: Rollout, replay: bool) -> tuple[np.ndarray, np.ndarray]:
        """-> (log p_train of the sampled tokens [C] float64, the top-k ids the forward used [P + C - 1, L, K])."""
        seq = rollout.prompt_ids + rollout.token_ids[:-1]  # every position whose next token was sampled or given
        rows = rollout.routed_experts
        if rows.shape[0] != len(seq) or rows.shape[1] != len(self.gates):
            raise ValueError(f"R3 rows {rows.shape} do not match {len(seq)} positions x {len(self.gates)} MoE "
                             "layers of the transformers model")
        used: list[torch.Tensor] = []
        with self._routing(rows if replay else None, used):
            logits = self.model(torch.tensor([seq], device=self.device)).logits[0].float()  # [S, V]
        logp = torch.log_softmax(logits, dim=-1)[len(rollout.prompt_ids) - 1 :]  # [C, V]
        chosen = logp.gather(1, torch.tensor(rollout.token_ids, device=self.device)[:, None])[:, 0]  # [C]
        return chosen.double().cpu().numpy(), torch.stack(used, dim=1).cpu().numpy()  # [C], [S, L, K]


def topk_sets_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[T, L, K] x2 -> [T, L] bool: the two top-k SETS differ (the order inside a set is not routing)."""
    return (np.sort(a, axis=-1) != np.sort(b, axis=-1)).any(axis=-1)


def measure(setting: EngineSetting, rollouts: Sequence[Rollout], trainer: Trainer) -> Mismatch:
    stats: dict[bool, tuple[float, float, float]] = {}
    for replay in (False, True):
        dp, k3, differ = [], [], []
        for r in rollouts:
            train_logp, used = trainer.score(r, replay)
            log_ratio = train_logp - r.logprobs  # [C], log(p_train / p_engine)
            dp.append(np.abs(np.exp(r.logprobs) - np.exp(train_logp)))
            k3.append(np.expm1(log_ratio) - log_ratio)
            differ.append(topk_sets_differ(used, r.routed_experts).ravel())
        if replay and any(d.any() for d in differ):
            raise AssertionError("the replayed forward used other expert ids than the R3 rows")
        stats[replay] = (float(np.concatenate(dp).mean()), float(np.concatenate(k3).mean()),
                         float(np.concatenate(differ).mean()))  # fmt: skip
    return Mismatch(setting.name, sum(len(r.token_ids) for r in rollouts), *stats[False], *stats[True])


def format_table(rows: Sequence[Mismatch]) -> str:
    head = (f"{'setting':<10} {'tokens':>6} | {'mean|dp|':>9} {'k3 KL':>9} {'topk differ':>11} | "
            f"{'mean|dp|':>9} {'k3 KL':>9} {'topk differ':>11}")  # fmt: skip
    lines = [f"{'':<17} | {'trainer routes itself':^31} | {'R3 replayed':^31}", head, "-" * len(head)]
    for m in rows:
        lines.append(f"{m.setting:<10} {m.tokens:>6} | {m.mean_abs_dp:>9.2e} {m.k3:>9.2e} {m.topk_differ:>11.4f} | "
                     f"{m.replay_mean_abs_dp:>9.2e} {m.replay_k3:>9.2e} {m.replay_topk_differ:>11.4f}")
    return "\n".join(lines)


def plot(rows: Sequence[Mismatch], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(rows))
    for ax, (label, own, replayed) in zip(axes, (("mean |p_engine - p_train|", "mean_abs_dp", "replay_mean_abs_dp"),
                                                 ("k3 KL(engine || train)", "k3", "replay_k3")), strict=True):
        ax.bar(x - 0.2, [getattr(m, own) for m in rows], 0.4, label="trainer routes itself")
        ax.bar(x + 0.2, [getattr(m, replayed) for m in rows], 0.4, label="R3 replayed")
        ax.set_xticks(x, [m.setting for m in rows])
        ax.set_title(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(model: str, settings: Sequence[str], prompts: Sequence[str], rollouts: int, max_tokens: int,
        seed: int = 0, device: str = "auto") -> list[Mismatch]:  # fmt: skip
    """device: where the engine and the trainer run (auto: CUDA when there is one)."""
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown settings {unknown}; use some of {', '.join(SETTINGS)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    trainer = Trainer(model, device)
    return [measure(SETTINGS[s], sample_rollouts(model, SETTINGS[s], prompts, rollouts, max_tokens, seed, device),
                    trainer) for s in settings]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> list[Mismatch]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face checkpoint directory transformers loads")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated: " + ", ".join(SETTINGS))
    ap.add_argument("--prompts", type=int, default=4, help=f"how many of the {len(DEFAULT_PROMPTS)} built-in prompts")
    ap.add_argument("--rollouts", type=int, default=2, help="sampled completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="engine and trainer")
    ap.add_argument("--png", help="write the plot here")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--preset", help="first write this real-shape preset (tools/model_presets.py) into --model, "
                                     "its weights initialised and saved by transformers itself")
    ap.add_argument("--layers", type=int, help="with --preset: cut it to this many decoder layers")
    args = ap.parse_args(argv)
    if args.preset:
        from model_presets import save_hf_checkpoint

        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        save_hf_checkpoint(args.preset, args.model, args.layers, device)
    rows = run(args.model, args.settings.split(","), DEFAULT_PROMPTS[: args.prompts], args.rollouts,
               args.max_tokens, args.seed, args.device)  # fmt: skip
    print(format_table(rows))
    if args.png:
        plot(rows, args.png)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(m) for m in rows], f, indent=1)
    return rows


if __name__ == "__main__":
    main()
