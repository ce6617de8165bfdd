"""tools/mismatch.py on the tiny Qwen3-MoE checkpoint transformers wrote (tests/hf_checkpoints.py): the
numbers are real. The bf16 engine and the bf16 transformers forward disagree on some router decisions
(near-ties their different kernels round apart), R3 replay removes every one of them, and replaying the
trainer's own routing into itself changes no bit."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from mismatch import DEFAULT_PROMPTS, SETTINGS, Rollout, Trainer, format_table, measure, sample_rollouts

PROMPTS = DEFAULT_PROMPTS[:3]


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoint_dir: Callable[[str], str]) -> str:
    return hf_checkpoint_dir("qwen3_moe")


@pytest.fixture(scope="module")
def trainer(checkpoint: str) -> Trainer:
    return Trainer(checkpoint)


@pytest.fixture(scope="module")
def rollouts(checkpoint: str) -> list[Rollout]:
    return sample_rollouts(checkpoint, SETTINGS["bf16"], PROMPTS, rollouts=1, max_tokens=8)


def test_replaying_the_trainers_own_routing_changes_no_bit(trainer: Trainer, rollouts: list[Rollout]) -> None:
    r = rollouts[0]
    own_logp, own_ids = trainer.score(r, replay=False)  # [C], [S, L, K]
    assert own_ids.shape == r.routed_experts.shape == (len(r.prompt_ids) + 7, 2, 2)
    replayed_logp, used = trainer.score(Rollout(r.prompt_ids, r.token_ids, r.logprobs, own_ids), replay=True)
    assert np.array_equal(used, own_ids)
    assert np.array_equal(replayed_logp, own_logp)
    # and replayed ids do drive the forward: every token sent to the next expert ids scores otherwise
    shifted = (own_ids + 1) % 8
    shifted_logp, used = trainer.score(Rollout(r.prompt_ids, r.token_ids, r.logprobs, shifted), replay=True)
    assert np.array_equal(used, shifted)
    assert (shifted_logp != own_logp).all()


def test_bf16_engine_flips_router_decisions_and_replay_removes_them(trainer: Trainer,
                                                                    rollouts: list[Rollout]) -> None:  # fmt: skip
    m = measure(SETTINGS["bf16"], rollouts, trainer)
    assert m.tokens == 3 * 8
    assert 0 < m.topk_differ < 0.1  # some (token, layer) sets differ: near-ties, not a broken mapping
    assert m.replay_topk_differ == 0.0
    # the engine's logprobs and the trainer's are close but not equal, in both views
    assert 0 < m.mean_abs_dp < 0.05 and 0 < m.replay_mean_abs_dp < 0.05
    assert m.k3 > 0 and m.replay_k3 > 0
    table = format_table([m])
    assert "bf16" in table and f"{m.topk_differ:.4f}" in table
