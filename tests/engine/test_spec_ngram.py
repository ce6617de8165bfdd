"""N-gram speculative decoding against the plain engine: the same tokens and the same R3 rows, bit for bit.

Tiny qwen3_moe with real routing, float32, block_size 4, 20 GPU blocks (four requests of ~30 tokens
do not fit: preemption) and a 24-block CPU tier. k = 3 drafts per step, n-grams of 1..3 tokens.

    plain engine     t0 | t1 | t2 | t3 ...                       one token per step
    spec engine      t0 | [t0 d1 d2 d3] -> t1 t2 (d3 rejected)   accepted drafts + a bonus per step

Repetitive prompts give drafts the target model accepts, random ones drafts it rejects; a rejected
draft's KV and routing rows are written and must never reach a response or the prefix cache. The
oracle drafters (every draft right / every draft wrong) pin the two ends: all accepted, all rejected.
Debug-mode rows are positions, so a row out of place shows as a wrong number.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from engine_runs import run_requests

from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.engine.engine_service import EngineService
from fastdeploy_r3.outputs import OutputAssembler, RequestOutput
from fastdeploy_r3.sampling_params import SamplingParams

BS, K = 4, 3
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
_rng = np.random.default_rng(7)
WORKLOAD = {
    "rep": [5, 6, 7, 8] * 4,  # drafts from the prompt's own repeats
    "rep2": [9, 10, 11] * 5,
    "rnd": _rng.integers(0, 400, 13).tolist(),  # drafts mostly rejected
    "rnd2": _rng.integers(0, 400, 9).tolist(),
}
FILLERS = [_rng.integers(0, 400, 30).tolist() for _ in range(2)]


def _config(model_dir: str, spec: bool, debug: bool = False) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model_dir, block_size=BS, num_gpu_blocks_override=20, num_cpu_blocks_override=24, max_num_seqs=4,
        max_num_batched_tokens=32, speculative_config=SPEC if spec else None,
        routing_replay_config={"enable_routing_replay": True, "debug_mode": debug},
    )


def _one(engine: EngineService, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> RequestOutput:
    return run_requests(engine, {rid: (prompt, params)})[rid]


def _assert_same(got: RequestOutput, ref: RequestOutput) -> None:
    """Same tokens and bit-identical rows; P + N - 1 of them."""
    comp, want = got.outputs[0], ref.outputs[0]
    assert comp.error is None and want.error is None, (comp.error, want.error)
    assert comp.token_ids == want.token_ids
    assert comp.routed_experts.shape[0] == len(got.prompt_token_ids) + len(comp.token_ids) - 1
    assert np.array_equal(comp.routed_experts, want.routed_experts)


def _assert_rows_are_positions(out: RequestOutput) -> None:
    comp = out.outputs[0]
    assert comp.error is None, comp.error
    end = len(out.prompt_token_ids) + len(comp.token_ids) - 1  # P + N - 1: the last token was never fed
    rows = comp.routed_experts
    assert rows.shape[0] == end
    want = (np.arange(end) % 255).astype(np.uint8)[:, None, None]
    assert np.array_equal(rows, np.broadcast_to(want, rows.shape))


class OracleDrafter:
    """Drafts from known greedy continuations: all right (`wrong=False`) or each one off by one id."""

    def __init__(self, sequences: list[list[int]], wrong: bool) -> None:
        self.sequences, self.wrong = sequences, wrong

    def propose(self, token_ids: np.ndarray, max_drafts: int) -> list[int]:
        token_ids = token_ids.tolist()
        for seq in self.sequences:
            if seq[: len(token_ids)] == token_ids:
                nxt = seq[len(token_ids) : len(token_ids) + max_drafts]
                return [(t + 1) % 400 for t in nxt] if self.wrong else nxt
        return []


@contextmanager
def _drafter(engine: EngineService, drafter: OracleDrafter) -> Iterator[None]:
    assert engine.speculation is not None
    before, engine.speculation.drafter = engine.speculation.drafter, drafter
    try:
        yield
    finally:
        engine.speculation.drafter = before


# -- engines, one of each per module -----------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(fake_model_dir: Callable[..., str]) -> str:
    return fake_model_dir("qwen3_moe")


@pytest.fixture(scope="module")
def plain(model_dir: str) -> Iterator[EngineService]:
    engine = EngineService(_config(model_dir, spec=False))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def spec(model_dir: str) -> Iterator[EngineService]:
    engine = EngineService(_config(model_dir, spec=True))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def debug_spec(model_dir: str) -> Iterator[EngineService]:
    engine = EngineService(_config(model_dir, spec=True, debug=True))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(plain: EngineService) -> dict[str, RequestOutput]:
    """The workload on the plain engine, all four at once (it preempts too)."""
    return run_requests(plain, {rid: (p, GREEDY) for rid, p in WORKLOAD.items()})


# -- greedy: equal to the plain engine -----------------------------------------------------------------


def test_greedy_speculation_gives_the_plain_engine_s_tokens_and_rows(
    spec: EngineService, reference: dict[str, RequestOutput]
) -> None:
    """All four at once through 20 blocks: preemptions, accepted and rejected drafts; every request
    has the plain engine's tokens and rows, bit for bit."""
    m0 = spec.metrics()
    got = run_requests(spec, {rid: (p, GREEDY) for rid, p in WORKLOAD.items()})
    for rid in WORKLOAD:
        _assert_same(got[rid], reference[rid])
        stats = got[rid].outputs[0].spec
        assert stats is not None and stats.verify_ct >= 1
    m = {k: spec.metrics()[k] - m0[k] for k in ("spec_draft_tokens", "spec_accepted_tokens", "preemptions")}
    assert m["preemptions"] > 0
    assert 0 < m["spec_accepted_tokens"] < m["spec_draft_tokens"]  # some accepted, some rejected
    assert sum(o.outputs[0].spec.accepted_tokens for o in got.values()) == m["spec_accepted_tokens"]
    spec.kv.check_integrity()


def test_prefix_hit_and_cpu_swap_serve_verified_blocks(
    spec: EngineService, plain: EngineService, reference: dict[str, RequestOutput]
) -> None:
    """Turn 2 sends rep + its 16 tokens: its full blocks, computed partly from accepted drafts and
    partly over slots that held rejected ones, are hit on GPU; fillers push them to the CPU tier and
    turn 3 swaps them back in. Tokens and rows equal the plain engine's, which runs the same turns."""
    turn2 = WORKLOAD["rep"] + reference["rep"].outputs[0].token_ids
    turn3 = turn2 + [1, 2]
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for engine in (spec, plain):
        engine.kv.flush()
        _one(engine, "t1", WORKLOAD["rep"])
    got2, ref2 = _one(spec, "t2", turn2, short), _one(plain, "t2", turn2, short)
    assert got2.num_cached_tokens == 28  # 7 full blocks of verified tokens
    _assert_same(got2, ref2)
    for i, filler in enumerate(FILLERS):
        _one(spec, f"f{i}", filler, short)
        _one(plain, f"f{i}", filler, short)
    m0 = spec.metrics()["swap_in_blocks"]
    got3, ref3 = _one(spec, "t3", turn3, short), _one(plain, "t3", turn3, short)
    assert spec.metrics()["swap_in_blocks"] > m0
    _assert_same(got3, ref3)
    spec.kv.check_integrity()


def test_an_aborted_request_publishes_no_row_and_caches_only_verified_blocks(
    spec: EngineService, plain: EngineService, reference: dict[str, RequestOutput]
) -> None:
    """rnd with every draft wrong, aborted after a few verify steps: its delta has no rows; a request
    continuing from its verified tokens hits its blocks and gets the plain engine's rows."""
    prompt, ref_tokens = WORKLOAD["rnd"], reference["rnd"].outputs[0].token_ids
    spec.kv.flush()
    with _drafter(spec, OracleDrafter([prompt + ref_tokens], wrong=True)):
        spec.add_request("ab", prompt, GREEDY)
        asm = OutputAssembler("ab")
        for _ in range(4):
            for delta in spec.step():
                asm.add(delta)
        spec.abort_request("ab")
        for _ in range(3):
            for delta in spec.step():
                asm.add(delta)
    out = asm.output().outputs[0]
    assert out.finish_reason == "abort" and out.routed_experts is None
    assert 2 <= len(out.token_ids) < len(ref_tokens) and out.token_ids == ref_tokens[: len(out.token_ids)]
    cont = prompt + out.token_ids
    got, ref = _one(spec, "cont", cont), _one(plain, "cont", cont)
    assert got.num_cached_tokens == (len(cont) - 1) // BS * BS
    _assert_same(got, ref)


def test_logprobs_chunked_prefill_and_penalties_are_the_plain_engine_s(
    spec: EngineService, plain: EngineService
) -> None:
    """A 40-token repetitive prompt (chunked: 32 + 8) asking for logprobs: the accepted tokens' logprobs
    are the target model's, as the plain engine computes them (to float32 rounding); a request with a
    repetition penalty gets no drafts (a rejected draft would count for its penalties) and the plain
    engine's tokens."""
    long_prompt = [3, 4, 5, 6, 7] * 8
    lp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    pen = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)
    reqs = {"lp": (long_prompt, lp), "pen": (WORKLOAD["rep"], pen)}
    got, want = run_requests(spec, reqs), run_requests(plain, reqs)
    _assert_same(got["lp"], want["lp"])
    # float32 logits of a verify row come out of a matmul over more rows than a decode step's, so they may
    # differ in the last bits (1e-6 here): the ids and ranks are equal, the values to rounding
    got_lp, want_lp = got["lp"].outputs[0].logprobs, want["lp"].outputs[0].logprobs
    assert len(got_lp) == len(want_lp) == 12
    for g, w in zip(got_lp, want_lp):
        assert (g.token_id, g.rank, [t for t, _ in g.top]) == (w.token_id, w.rank, [t for t, _ in w.top])
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-5)
    assert got["lp"].outputs[0].spec.accepted_tokens > 0
    _assert_same(got["pen"], want["pen"])
    assert got["pen"].outputs[0].spec.draft_tokens == 0


def test_each_verify_step_leaves_before_the_outputs_of_the_one_before(
    spec: EngineService, plain: EngineService, reference: dict[str, RequestOutput]
) -> None:
    """No verify step can be planned ahead (its drafts follow what the step before accepted), so the
    engine sends it as soon as the step before is collected and only then builds that step's deltas:
    every step() returns with the next one on the workers. A pause collects that one (its tokens go out,
    none lost) and sends nothing more; after the resume the request ends with the plain engine's tokens
    and rows. The plain engine plans its decode steps ahead instead and sends none early."""
    def sent_early() -> float:
        return spec.metrics()["early_sent_steps"]

    asm = OutputAssembler("early")
    spec.add_request("early", WORKLOAD["rep"], GREEDY)
    for _ in range(3):
        before = sent_early()
        for delta in spec.step():
            asm.add(delta)
        assert sent_early() == before + 1
    got_before_pause = len(asm.output().outputs[0].token_ids)
    spec.control.pause("in_place")
    steps = spec.metrics()["steps"]
    for _ in range(2):
        for delta in spec.step():
            asm.add(delta)
    assert spec.metrics()["steps"] == steps  # paused: no step ran or was sent
    assert len(asm.output().outputs[0].token_ids) > got_before_pause  # the collected step's tokens went out
    spec.control.resume()
    while spec.has_unfinished_requests():
        for delta in spec.step():
            asm.add(delta)
    _assert_same(asm.output(), reference["rep"])
    assert plain.metrics()["early_sent_steps"] == 0 and plain.metrics()["overlapped_steps"] > 0


# -- the two ends, in debug mode (rows are positions) -----------------------------------------------


@pytest.mark.parametrize("wrong", [False, True], ids=["all-accepted", "all-rejected"])
def test_all_accepted_and_all_rejected_give_p_plus_n_minus_1_rows(
    debug_spec: EngineService, reference: dict[str, RequestOutput], wrong: bool
) -> None:
    prompt, ref_tokens = WORKLOAD["rnd2"], reference["rnd2"].outputs[0].token_ids
    with _drafter(debug_spec, OracleDrafter([prompt + ref_tokens], wrong)):
        out = _one(debug_spec, f"end-{wrong}", prompt)
    assert out.outputs[0].token_ids == ref_tokens
    _assert_rows_are_positions(out)
    stats = out.outputs[0].spec
    assert stats is not None and stats.draft_tokens > 0
    if wrong:
        assert stats.accepted_tokens == 0 and stats.verify_ct == len(ref_tokens)
    else:
        # every step, the prefill's too, verifies k drafts and adds a bonus: 16 tokens in 4 steps
        assert stats.accepted_tokens == stats.draft_tokens == len(ref_tokens) - stats.verify_ct
        assert stats.verify_ct == len(ref_tokens) // (K + 1) == 4


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there(
    debug_spec: EngineService, reference: dict[str, RequestOutput]
) -> None:
    """Every draft right; the reference's 3rd token is a stop id: it arrives in the prefill step's list
    [t0 t1 t2 t3] (the prefill verifies drafts too); t3 is dropped, no row past the stop."""
    prompt, ref_tokens = WORKLOAD["rnd2"], reference["rnd2"].outputs[0].token_ids
    stop = ref_tokens[2]
    first = ref_tokens.index(stop)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop])
    with _drafter(debug_spec, OracleDrafter([prompt + ref_tokens], wrong=False)):
        out = _one(debug_spec, "stop", prompt, params)
    comp = out.outputs[0]
    assert comp.token_ids == ref_tokens[: first + 1]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", stop)
    _assert_rows_are_positions(out)


def test_a_stop_string_inside_an_accepted_run_ends_the_request_there(
    debug_spec: EngineService, reference: dict[str, RequestOutput], model_dir: str
) -> None:
    """Every draft right; the stop string is the text of two adjacent reference tokens (printable ASCII):
    the request ends at the token that completes it, the accepted drafts after it are dropped."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    prompt, ref_tokens = WORKLOAD["rnd2"], reference["rnd2"].outputs[0].token_ids
    texts = [tok.decode([t]) for t in ref_tokens]
    i = next(i for i in range(1, len(texts) - 1)
             if all(x.isascii() and x.isprintable() and x.strip() for x in texts[i : i + 2]))
    stop = texts[i] + texts[i + 1]
    end = next(j for j in range(len(ref_tokens)) if stop in tok.decode(ref_tokens[: j + 1]))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    with _drafter(debug_spec, OracleDrafter([prompt + ref_tokens], wrong=False)):
        out = _one(debug_spec, "stopstr", prompt, params)
    comp = out.outputs[0]
    assert comp.token_ids == ref_tokens[: end + 1]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", stop)
    assert stop not in comp.text
    _assert_rows_are_positions(out)
    assert end % (K + 1) != K  # the stop is not the last token of a verify step's list: drafts were dropped


def test_max_tokens_inside_an_accepted_run(debug_spec: EngineService, reference: dict[str, RequestOutput]) -> None:
    """max_tokens 6 with every draft right: [t0..t3] from the prefill, then one draft (the bonus is the
    6th token): [t4 t5]; 6 tokens, P + 5 rows."""
    prompt, ref_tokens = WORKLOAD["rnd2"], reference["rnd2"].outputs[0].token_ids
    with _drafter(debug_spec, OracleDrafter([prompt + ref_tokens], wrong=False)):
        out = _one(debug_spec, "len", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert out.outputs[0].token_ids == ref_tokens[:6] and out.outputs[0].finish_reason == "length"
    assert (out.outputs[0].spec.verify_ct, out.outputs[0].spec.draft_tokens) == (2, 4)
    _assert_rows_are_positions(out)


# -- sampled ---------------------------------------------------------------------------------------------


def test_a_seeded_sampled_request_draws_plain_decoding_s_tokens(plain: EngineService, spec: EngineService) -> None:
    """Every row draws what plain decoding draws at its (seed, position); a draft is kept when the draw
    equals it: the same seeded request alone and beside another gives the plain engine's tokens, and the
    repeated prompt gets drafts accepted."""
    params = SamplingParams(temperature=0.7, seed=123, max_tokens=12, ignore_eos=True)
    want = _one(plain, "s0", WORKLOAD["rep2"], params)
    a = _one(spec, "s1", WORKLOAD["rep2"], params)
    b = run_requests(spec, {"s2": (WORKLOAD["rep2"], params), "other": (WORKLOAD["rnd"], GREEDY)})["s2"]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == want.outputs[0].token_ids
    assert len(a.outputs[0].token_ids) == 12
    assert a.outputs[0].spec is not None and a.outputs[0].spec.draft_tokens > 0
    assert a.outputs[0].spec.accepted_tokens > 0
