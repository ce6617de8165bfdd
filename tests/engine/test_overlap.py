"""Overlap scheduling (engine/overlap.py) gives what the synchronous engine gives.

Two engines on the same tiny checkpoint with real routing (rows depend on the tokens fed, so a wrong
placeholder substitution shows): one plans each step while the previous one runs, one has
--disable-overlap-schedule. A GPU cache too small for the load (preemptions) and a CPU tier (swaps
out and in) are part of both. Same greedy and seeded tokens, same logprobs, same R3 rows, stops
applied one step late without an extra row, and a discarded chunk never cached.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from engine_runs import run_requests
from failing_runner import FAIL_POSITION, FailingRunner

from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.engine.engine_service import EngineService
from fastdeploy_r3.outputs import OutputAssembler, RequestOutput
from fastdeploy_r3.sampling_params import SamplingParams

BS = 2
PROMPTS = {
    "len": [7, 21, 5, 300, 42, 9, 77],
    "stopid": [11, 12, 13, 14, 15, 16],
    "stopstr": [99, 98, 97, 96, 95, 94, 93, 92],
    "seeded": [3, 5, 8, 13, 21, 34, 55],
    "choices": [400, 401, 402, 403, 404],
    "plp": [250, 251, 252, 253, 254, 255, 256],
}


def _config(model_dir: str, disable: bool) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model_dir, block_size=BS, num_gpu_blocks_override=20, num_cpu_blocks_override=24, max_num_seqs=4,
        max_num_batched_tokens=16, disable_overlap_schedule=disable,
        routing_replay_config={"enable_routing_replay": True},
    )


@pytest.fixture(scope="module", params=["worker finishes each step", "worker launches the next step first"])
def engines(request: pytest.FixtureRequest, fake_model_dir: Callable[..., str]):
    """The overlapped engine twice: its worker finishing each step before taking the next (the CPU's
    default), and launching the step planned ahead before finishing the one before (CUDA's default,
    worker_process.StepPipeline), forced here with FDR3_PIPELINE_STEPS=1."""
    model_dir = fake_model_dir("qwen3_moe")
    # FailingRunner: the ordinary runner, but a request named "boom..." or "late..." makes the step
    # feeding its position 9 fail (test_a_failed_step_in_flight_...)
    with pytest.MonkeyPatch.context() as mp:  # the spawned workers read it at start
        mp.setenv("FDR3_PIPELINE_STEPS", "1" if "first" in request.param else "0")
        on = EngineService(_config(model_dir, False), runner_cls=FailingRunner)
    off = EngineService(_config(model_dir, True), runner_cls=FailingRunner)
    try:
        yield on, off
    finally:
        on.shutdown()
        off.shutdown()


@pytest.fixture(scope="module")
def workload(engines) -> dict[str, tuple[list[int], SamplingParams]]:
    """Stop ids and strings taken from what the synchronous engine generates, so that they stop mid-way."""
    _, off = engines
    plain = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    ref = run_requests(off, {"stopid": (PROMPTS["stopid"], plain), "stopstr": (PROMPTS["stopstr"], plain)})
    toks, p = ref["stopid"].outputs[0].token_ids, len(PROMPTS["stopid"])
    # stop at the first new token from the third on that makes P + N even: then the discarded position
    # P + N - 1 completes a block (BS = 2), which a wrongly advanced cursor would cache
    stop_id = next(t for i, t in enumerate(toks) if i >= 2 and t not in toks[:i] and (p + i + 1) % BS == 0)
    text = ref["stopstr"].outputs[0].text
    assert len(text) >= 6, text
    return {
        "len": (PROMPTS["len"], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)),
        "stopid": (PROMPTS["stopid"], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True,
                                                     stop_token_ids=[stop_id])),
        "stopstr": (PROMPTS["stopstr"], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True,
                                                       stop=[text[4:6]])),
        "seeded": (PROMPTS["seeded"], SamplingParams(temperature=0.9, seed=7, max_tokens=8, ignore_eos=True,
                                                     presence_penalty=0.5, logprobs=2)),
        "choices": (PROMPTS["choices"], SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=6,
                                                       ignore_eos=True)),
        "plp": (PROMPTS["plp"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=1)),
    }


def _assert_same_logprobs(got: list | None, want: list | None, rid: str) -> None:
    """Same ids and ranks; values equal up to float noise (the batches around a request differ)."""
    assert (got is None) == (want is None), rid
    for g, w in zip(got or [], want or [], strict=True):
        assert (g is None) == (w is None), rid
        if g is not None:
            assert (g.token_id, g.rank, [t for t, _ in g.top]) == (w.token_id, w.rank, [t for t, _ in w.top]), rid
            assert g.logprob == pytest.approx(w.logprob, abs=1e-4), rid


def _metric_delta(engine: EngineService, before: dict[str, float], *names: str) -> dict[str, float]:
    after = engine.metrics()
    return {n: after[n] - before[n] for n in names}


def _assert_same_outputs(got: dict[str, RequestOutput], want: dict[str, RequestOutput],
                         requests: dict[str, tuple[list[int], SamplingParams]]) -> None:
    assert set(got) == set(want) == set(requests)
    for rid, (prompt, _) in requests.items():
        for g, w in zip(got[rid].outputs, want[rid].outputs, strict=True):
            assert g.error is None and w.error is None, (rid, g.error, w.error)
            assert g.token_ids == w.token_ids, rid
            assert g.text == w.text and g.finish_reason == w.finish_reason, rid
            _assert_same_logprobs(g.logprobs, w.logprobs, rid)
            # a stop seen one step late published no extra row: P + N - 1 rows, the same ones
            assert g.routed_experts.shape[0] == len(prompt) + len(g.token_ids) - 1, rid
            assert np.array_equal(g.routed_experts, w.routed_experts), rid
        _assert_same_logprobs(got[rid].prompt_logprobs, want[rid].prompt_logprobs, rid)


def test_stops_are_applied_one_step_late_and_the_extra_chunk_discarded(engines, workload) -> None:
    """Three requests decoding side by side, every step after the prompts' planned ahead: the stop id and
    the stop string are seen while the next step runs; that step's chunk of each is thrown away."""
    on, off = engines
    reqs = {k: workload[k] for k in ("len", "stopid", "stopstr")}
    names = ("overlapped_steps", "discarded_chunks")
    m_on = on.metrics()
    got, want = run_requests(on, reqs), run_requests(off, reqs)
    _assert_same_outputs(got, want, reqs)
    assert got["stopid"].outputs[0].finish_reason == "stop" and len(got["stopid"].outputs[0].token_ids) < 9
    assert got["stopstr"].outputs[0].stop_reason == workload["stopstr"][1].stop[0]
    assert len(got["stopstr"].outputs[0].token_ids) < 9
    d_on = _metric_delta(on, m_on, *names)
    # "len" ends at max_tokens, known ahead: never planned past it; the two stops were each one chunk late
    assert d_on["discarded_chunks"] == 2 and d_on["overlapped_steps"] >= 5, d_on
    on.kv.check_integrity()
    assert on.kv.gpu.num_free_blocks == on.num_gpu_blocks  # every block back, none held by a discarded chunk


def test_overlap_serves_what_the_synchronous_engine_serves(engines, workload, request: pytest.FixtureRequest) -> None:
    """Under memory pressure (preemptions, CPU-tier swaps), with n > 1, penalties, seeds and prompt logprobs."""
    on, off = engines
    m_on, m_off = on.metrics(), off.metrics()
    got, want = run_requests(on, workload), run_requests(off, workload)
    # a second wave extends every prompt: the first wave's prompt blocks, pushed out of the small GPU
    # cache into the CPU tier, come back in (swap-in) on both engines
    again = {f"{rid}2": (prompt + [60, 61, 62], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
             for rid, (prompt, _) in workload.items()}
    got.update(run_requests(on, again))
    want.update(run_requests(off, again))
    _assert_same_outputs(got, want, workload | again)
    names = ("overlapped_steps", "discarded_chunks", "preemptions", "swap_in_blocks", "launched_ahead_steps")
    d_on, d_off = _metric_delta(on, m_on, *names), _metric_delta(off, m_off, *names)
    print("\noverlap on", d_on, "\noverlap off", d_off)
    assert d_off["overlapped_steps"] == 0 and d_off["discarded_chunks"] == 0
    assert d_on["overlapped_steps"] > 0, d_on
    if "first" in request.node.callspec.params["engines"]:
        assert d_on["launched_ahead_steps"] > 0, d_on  # the worker did launch steps before finishing others
    else:
        assert d_on["launched_ahead_steps"] == 0, d_on
    assert d_on["preemptions"] > 0 and d_off["preemptions"] > 0, (d_on, d_off)
    assert d_on["swap_in_blocks"] > 0 and d_off["swap_in_blocks"] > 0, (d_on, d_off)
    on.kv.check_integrity()
    off.kv.check_integrity()
    assert on.kv.gpu.num_free_blocks == on.num_gpu_blocks  # every block back, none held by a discarded chunk


def test_a_discarded_chunk_is_never_prefix_cached(engines, workload) -> None:
    """A request stopping at token N: its extra chunk computed position P + N - 1 in overlap. A follow-up
    prompt that extends the stopped sequence hits exactly the blocks the synchronous engine cached."""
    on, off = engines
    for engine in (on, off):
        engine.kv.flush()
    prompt, params = workload["stopid"]
    first = {e: run_requests(e, {f"a{id(e)}": (prompt, params)}) for e in (on, off)}
    hits = {}
    for e in (on, off):
        out = first[e][f"a{id(e)}"].outputs[0]
        follow = prompt + out.token_ids + [17, 18]
        before = e.metrics()
        run_requests(e, {f"b{id(e)}": (follow, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))})
        hits[e] = _metric_delta(e, before, "prefix_hit_blocks")["prefix_hit_blocks"]
    assert first[on][f"a{id(on)}"].outputs[0].token_ids == first[off][f"a{id(off)}"].outputs[0].token_ids
    # only full blocks of computed tokens: P + N - 1 of them were forwarded
    n_tokens = len(prompt) + len(first[off][f"a{id(off)}"].outputs[0].token_ids)
    assert n_tokens % BS == 0  # the workload's stop id makes the discarded position complete a block
    assert hits[on] == hits[off] == (n_tokens - 1) // BS


def test_aborts_while_a_step_is_in_flight(engines, workload) -> None:
    """An abort lands between steps, so with overlap while the aborted request's next chunk runs: the
    others are served as without overlap, the aborted one returns no rows, every block comes back."""
    on, off = engines
    reqs = {k: workload[k] for k in ("len", "seeded", "plp")}
    got = run_requests(on, reqs, abort_after={"len": 2})
    want = run_requests(off, {k: v for k, v in reqs.items() if k != "len"})
    aborted = got["len"].outputs[0]
    assert aborted.finish_reason == "abort" and aborted.routed_experts is None
    assert 2 <= len(aborted.token_ids) < 7
    for rid in ("seeded", "plp"):
        g, w = got[rid].outputs[0], want[rid].outputs[0]
        assert g.token_ids == w.token_ids and np.array_equal(g.routed_experts, w.routed_experts), rid
    on.kv.check_integrity()
    assert on.kv.gpu.num_free_blocks == on.num_gpu_blocks


def test_control_calls_drain_the_step_in_flight(engines, workload) -> None:
    """A control call between steps (here a weights checksum) first collects the step in flight, so its
    answers are the control message's; the request then finishes as without the call."""
    on, off = engines
    prompt, params = workload["len"]
    on.add_request("c", prompt, params)
    assemblers = OutputAssembler("c")
    while on._in_flight is None:
        for d in on.step():
            assemblers.add(d)
    sums = on.control.call_workers(_checksum_message())
    assert on._in_flight is None and sums[0].error is None and sums[0].checksums
    while on.has_unfinished_requests():
        for d in on.step():
            assemblers.add(d)
    want = run_requests(off, {"c": (prompt, params)})["c"].outputs[0]
    assert assemblers.output().outputs[0].token_ids == want.token_ids


def _checksum_message() -> object:
    from fastdeploy_r3.worker.messages import ChecksumWeights

    return ChecksumWeights()


@pytest.mark.parametrize("culprit, error", [("boom", "ValueError"), ("late", "NonFiniteLogitsError")])
def test_a_failed_step_in_flight_fails_its_culprit_alone(engines, workload, culprit: str, error: str) -> None:
    """The decode step feeding the culprit's position 9 fails: "boom" while it is launched, "late" when it
    is finished (no token drawn, as for NaN logits), which a pipelined worker does after launching the
    next step. With overlap the next step was already sent, feeding the failed step's tokens: the worker
    refuses it, the engine discards it, bisects the failed step synchronously (the culprit fails alone)
    and serves the others as the synchronous engine does (penalty counts included: "seeded" has one)."""
    on, off = engines
    greedy = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    assert len(prompt) < FAIL_POSITION < len(prompt) + 7  # fails while decoding
    reqs = {"len": workload["len"], culprit: (prompt, greedy), "seeded": workload["seeded"]}
    m_on = on.metrics()
    got = run_requests(on, reqs)
    want = run_requests(off, {k: v for k, v in reqs.items() if k != culprit})
    failed = got[culprit].outputs[0]
    assert failed.finish_reason == "error" and failed.routed_experts is None
    assert f"failed on this request alone ({error})" in failed.error
    # the tokens at positions 7, 8 and 9 were sampled; the step feeding position 9 failed
    assert len(failed.token_ids) == FAIL_POSITION - len(prompt) + 1
    _assert_same_outputs({k: got[k] for k in want}, want, {k: reqs[k] for k in want})
    assert _metric_delta(on, m_on, "discarded_steps")["discarded_steps"] == 1
    on.kv.check_integrity()
    assert on.kv.gpu.num_free_blocks == on.num_gpu_blocks
