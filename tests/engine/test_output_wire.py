"""The packed step outputs (engine/output_wire.py) give back exactly the deltas they were packed from,
through pickle as over the ZMQ boundary, for a step mixing every kind of request the engine sends."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np

from fastdeploy_r3.engine.messages import OutputBatch
from fastdeploy_r3.logprobs import TokenLogprob
from fastdeploy_r3.outputs import CompletionDelta, RequestDelta, SpecDecodeStats, TextRule, WeightVersionSpan


def _v(version: str, end: int) -> list[WeightVersionSpan]:
    return [WeightVersionSpan(version, 0, end)]


def mixed_step() -> list[RequestDelta]:
    rows = np.arange(5 * 2 * 4, dtype=np.uint8).reshape(5, 2, 4)  # [rows, L, K]
    lp = [TokenLogprob(7, -0.25, 1, [(7, -0.25), (9, -1.5)]), TokenLogprob(8, -2.0, 3, [], entropy=0.5,
                                                                           kept_ids=[8, 1])]
    return [
        # a streaming request's first delta: the prompt, the layer ids, prompt logprobs, text left to the server
        RequestDelta("cmpl-stream", [CompletionDelta(0, "", [11], routed_experts_start=0, text_rule=TextRule.PUSH,
                                                     weight_versions=_v("v1", 1))],
                     finished=False, num_cached_tokens=16, prompt="héllo", prompt_token_ids=[1, 2, 3],
                     moe_layer_ids=[1, 2], prompt_logprobs=[None, TokenLogprob(2, -0.5, 2, [(5, -0.1)])]),
        # n = 3: choice 0 finishes at its length with R3 rows, logprobs and speculative decoding counts,
        # choice 2 goes on, choice 1 is not in this step (it finished earlier)
        RequestDelta("cmpl-n3", [
            CompletionDelta(0, "日本", [7, 8], finish_reason="length", routed_experts=rows, routed_experts_start=1,
                            logprobs=lp, weight_versions=_v("v1", 4), spec=SpecDecodeStats(3, 6, 2)),
            CompletionDelta(2, "", [], weight_versions=_v("v1", 3), routed_experts_start=1),
        ], finished=False),
        # aborted by its client, in words
        RequestDelta("cmpl-abort", [CompletionDelta(0, "x", [4], finish_reason="abort", finish_message="client left",
                                                    weight_versions=_v("v2", 2))], finished=True),
        # failed closed: an error, no rows
        RequestDelta("cmpl-error", [CompletionDelta(0, "", [5, 6], finish_reason="error",
                                                    error="RoutingReplayError: row 3 carries tag 9",
                                                    weight_versions=_v("v1", 2))], finished=True),
        # stopped by a stop token id, text trimmed by the server, across an in-place weight update
        RequestDelta("cmpl-stop", [CompletionDelta(
            0, "", [3, 2], finish_reason="stop", stop_reason=2, text_rule=TextRule.PUSH_BUT_LAST_FLUSH,
            weight_versions=[WeightVersionSpan("v1", 0, 3), WeightVersionSpan("v2", 3, 5)],
            spans_weight_versions=True)], finished=True),
        # a stop string, and a choice that has no version span yet
        RequestDelta("cmpl-stopstr", [CompletionDelta(0, "ok", [1], finish_reason="stop", stop_reason="END"),
                                      CompletionDelta(1, "", [], weight_versions=[])], finished=False),
    ]


def assert_same(got: list[RequestDelta], want: list[RequestDelta]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert [c.index for c in g.outputs] == [c.index for c in w.outputs]
        for gc, wc in zip(g.outputs, w.outputs):
            for f in dataclasses.fields(CompletionDelta):
                a, b = getattr(gc, f.name), getattr(wc, f.name)
                if isinstance(b, np.ndarray):
                    assert isinstance(a, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), f.name
                else:
                    assert a == b and type(a) is type(b), (w.request_id, f.name, a, b)
        g.outputs, w.outputs = [], []
        assert g == w


def test_a_mixed_step_round_trips_exactly_through_the_wire() -> None:
    batch = OutputBatch.of(mixed_step())
    p = batch.packed
    # the common part is flat: 8 choice rows, their 9 token ids in one buffer, extras only where set
    assert len(p) == 6 and p.token_ids.tolist() == [11, 7, 8, 4, 5, 6, 3, 2, 1]
    assert p.text == "日本xok" and p.versions == ["v1", "v2"]
    assert sorted(p.choice_extras) == [1, 3, 4, 5, 6, 7] and sorted(p.request_extras) == [0]
    assert_same(pickle.loads(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)).unpack(), mixed_step())


def test_an_empty_step_round_trips() -> None:
    assert OutputBatch.of([]).unpack() == []


def test_the_one_span_fast_path_is_weight_version_spans_without_updates() -> None:
    from fastdeploy_r3.engine.request import Request
    from fastdeploy_r3.engine.request_groups import _spans
    from fastdeploy_r3.outputs import weight_version_spans
    from fastdeploy_r3.sampling_params import SamplingParams

    req = Request("r", [1, 2], SamplingParams(), weight_version="v3")
    for n in (0, 1, 7):
        assert _spans(req, n) == weight_version_spans([], "v3", n) == [WeightVersionSpan("v3", 0, n)]
