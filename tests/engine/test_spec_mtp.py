"""GLM-4.5 MTP speculative decoding against the plain engine: the same tokens and R3 rows, bit for bit.

The checkpoints are written by the installed transformers (tests/hf_checkpoints.py) with a draft (MTP)
layer appended under GLM-4.5's names. The engines run a one-layer GLM whose draft layer copies the policy
one position ahead, so most drafts are accepted and some are not; float32, greedy, block_size 4.

    plain engine   t0 | t1 | t2 | t3 ...                 one token per step
    mtp engine     t0 -> drafts x1 x2 x3 (worker/mtp_drafter.py) | [t1 x1 x2 x3] -> accepted + bonus

The draft layer's MoE block routes too, and must never reach R3: a response has the policy's one MoE
layer per row, P + N - 1 rows, equal to the plain engine's.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from engine_runs import run_requests
from hf_checkpoints import write_glm_checkpoint_drafting_like_its_policy
from safetensors import safe_open

from fastdeploy_r3.config import ConfigError, EngineConfig, ModelConfig
from fastdeploy_r3.engine.engine_service import EngineService
from fastdeploy_r3.model_executor.model_loader import load_model
from fastdeploy_r3.outputs import RequestOutput
from fastdeploy_r3.sampling_params import SamplingParams

BS, K = 4, 3
MTP = {"method": "mtp", "num_speculative_tokens": K}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
_rng = np.random.default_rng(3)
WORKLOAD = {f"r{i}": _rng.integers(0, 256, 9 + i).tolist() for i in range(4)}
WORKLOAD["long"] = _rng.integers(0, 256, 45).tolist()  # prefilled in two chunks of the 32-token budget
CPU = torch.device("cpu")


def _config(model_dir: str, spec: bool) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model_dir, block_size=BS, num_gpu_blocks_override=20, num_cpu_blocks_override=24, max_num_seqs=4,
        max_num_batched_tokens=32,
        speculative_config=MTP if spec else None, routing_replay_config={"enable_routing_replay": True},
    )


def _assert_same(got: RequestOutput, ref: RequestOutput, num_moe_layers: int) -> None:
    comp, want = got.outputs[0], ref.outputs[0]
    assert comp.error is None and want.error is None, (comp.error, want.error)
    assert comp.token_ids == want.token_ids
    assert comp.routed_experts.shape == (len(got.prompt_token_ids) + len(comp.token_ids) - 1, num_moe_layers, 4)
    assert np.array_equal(comp.routed_experts, want.routed_experts)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_glm_checkpoint_drafting_like_its_policy(str(tmp_path_factory.mktemp("glm-mtp")))


@pytest.fixture(scope="module")
def plain(model_dir: str) -> Iterator[EngineService]:
    engine = EngineService(_config(model_dir, spec=False))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def mtp(model_dir: str) -> Iterator[EngineService]:
    engine = EngineService(_config(model_dir, spec=True))
    yield engine
    engine.shutdown()


def test_the_draft_layer_loads_under_glm_names_and_leaves_the_policy_alone(
    hf_checkpoint_dir: Callable[[str], str],
) -> None:
    """The 4-layer checkpoint's model.layers.4.* become the draft layer (random weights, real shapes); the
    policy is the one a plain load gives, and the draft MoE block's index is past the policy's two."""
    src = hf_checkpoint_dir("glm4_moe")
    with_draft = load_model(ModelConfig(model=src), CPU, with_draft_layers=True)
    plain = load_model(ModelConfig(model=src), CPU)
    draft = with_draft.draft_layer
    assert draft is not None and plain.draft_layer is None
    with safe_open(os.path.join(src, "model-mtp.safetensors"), framework="pt") as f:
        assert torch.equal(draft.eh_proj.weight, f.get_tensor("model.layers.4.eh_proj.weight"))
        assert torch.equal(draft.shared_head.head.weight, f.get_tensor("model.layers.4.shared_head.head.weight"))
        gate0 = f.get_tensor("model.layers.4.mlp.experts.0.gate_proj.weight")  # [I, H]
        assert torch.equal(draft.mlp.experts.w13[0, : gate0.shape[0]], gate0)
    policy = {n: t for n, t in with_draft.state_dict().items() if not n.startswith("mtp.")}
    assert policy.keys() == plain.state_dict().keys()
    assert all(torch.equal(t, plain.state_dict()[n]) for n, t in policy.items())
    assert with_draft.moe_layer_ids == [2, 3] and draft.mlp.moe_index == 2
    assert "model.layers.4.enorm.weight" in with_draft.checkpoint_weight_shapes()


def test_dummy_weights_draw_the_same_policy_with_or_without_the_draft_layer(tmp_path: str) -> None:
    """load_format dummy draws the policy's tensors first: a draft layer adds draws after them."""
    from fake_model import make_fake_model

    d = make_fake_model("glm4_moe", str(tmp_path / "glm"), draft_layer=True)  # the draft layer's tensors saved too
    mc = ModelConfig(model=d, load_format="dummy")
    with_draft, plain = load_model(mc, CPU, with_draft_layers=True), load_model(mc, CPU)
    assert with_draft.draft_layer is not None
    want = plain.state_dict()
    assert all(torch.equal(t, want[n]) for n, t in with_draft.state_dict().items() if not n.startswith("mtp."))


def test_greedy_mtp_gives_the_plain_engine_s_tokens_and_rows(
    plain: EngineService, mtp: EngineService
) -> None:
    """Five requests through 20 blocks (preemptions), one prefilled in two chunks: drafts are made, most
    accepted, some rejected; every request has the plain engine's tokens and its one-MoE-layer rows, bit
    for bit."""
    reference = run_requests(plain, {rid: (p, GREEDY) for rid, p in WORKLOAD.items()})
    m0 = mtp.metrics()
    got = run_requests(mtp, {rid: (p, GREEDY) for rid, p in WORKLOAD.items()})
    for rid in WORKLOAD:
        _assert_same(got[rid], reference[rid], num_moe_layers=1)
    m = {k: mtp.metrics()[k] - m0[k] for k in ("spec_draft_tokens", "spec_accepted_tokens", "preemptions")}
    assert 0 < m["spec_accepted_tokens"] < m["spec_draft_tokens"]
    assert m["preemptions"] > 0
    assert sum(o.outputs[0].spec.accepted_tokens for o in got.values()) == m["spec_accepted_tokens"]
    assert got["long"].outputs[0].spec.accepted_tokens > 0  # drafted after a chunked prefill too
    mtp.kv.check_integrity()

    # turn 2 of r0 hits its verified blocks in the prefix cache; the draft layer starts over at the chunk
    turn2 = WORKLOAD["r0"] + reference["r0"].outputs[0].token_ids + [7, 8, 9]
    ref2 = run_requests(plain, {"t2": (turn2, GREEDY)})["t2"]
    got2 = run_requests(mtp, {"t2": (turn2, GREEDY)})["t2"]
    assert got2.num_cached_tokens == ref2.num_cached_tokens == (len(turn2) - 1) // BS * BS
    _assert_same(got2, ref2, num_moe_layers=1)
    assert got2.outputs[0].spec.accepted_tokens > 0


def test_seeded_sampled_requests_under_mtp_draw_plain_decoding_s_tokens(
        plain: EngineService, mtp: EngineService) -> None:
    """A sampled row draws what plain decoding draws at its (seed, position) and keeps the draft when the
    draw equals it (worker/sample/draw.py): seeded requests give the plain engine's tokens whatever the
    draft layer proposed, some drafts are accepted, and the rows are P + N - 1."""
    params = SamplingParams(temperature=0.8, seed=42, max_tokens=12, ignore_eos=True)
    batch = {"s1": (WORKLOAD["r1"], params), "s2": (WORKLOAD["r2"], params)}
    want, out = run_requests(plain, batch), run_requests(mtp, batch)
    for rid, o in out.items():
        comp = o.outputs[0]
        assert comp.error is None and comp.token_ids == want[rid].outputs[0].token_ids
        assert comp.routed_experts.shape == (len(o.prompt_token_ids) + 11, 1, 4)
    assert sum(o.outputs[0].spec.accepted_tokens for o in out.values()) > 0


def test_mtp_is_refused_for_a_model_without_a_draft_layer(
    fake_model_dir: Callable[..., str], hf_checkpoint_dir: Callable[[str], str], tmp_path: str,
) -> None:
    for model in (fake_model_dir("qwen3_moe"), fake_model_dir("glm4_moe")):  # the fake GLM has none by default
        with pytest.raises(ConfigError, match=r'"mtp" needs a checkpoint with a draft \(MTP\) layer.*"ngram"'):
            EngineConfig.from_kwargs(model, speculative_config=MTP)
    glm = hf_checkpoint_dir("glm4_moe")
    with pytest.raises(ConfigError, match="runs its draft layer on one rank; tensor_parallel_size=2"):
        EngineConfig.from_kwargs(glm, speculative_config=MTP, tensor_parallel_size=2)
    # config.json that says it has none while the weights are there: the model builder refuses too
    d = str(tmp_path / "glm")
    shutil.copytree(glm, d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**cfg, "num_nextn_predict_layers": 0}, f)
    with pytest.raises(ConfigError, match="no draft"):
        load_model(ModelConfig(model=d), CPU, with_draft_layers=True)
