"""Detokenization off the engine loop: with TokenProcessor.detokenize_all off, a request without stop
strings leaves its text to the receiver (DeltaDetokenizer, in the API server), which must give the
same text, delta for delta, as the engine gives when it detokenizes itself, for every way a request
ends: its length, a trimmed or kept stop token, EOS, an abort in the middle of a character, several
tokens in one step; requests with stop strings stay with the engine."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from test_detokenizer import ByteTokenizer, ReleasingScheduler

from fastdeploy_r3.engine.detokenizer import DeltaDetokenizer
from fastdeploy_r3.engine.request import RequestStatus
from fastdeploy_r3.engine.request_groups import RequestGroups
from fastdeploy_r3.engine.token_processor import TokenProcessor
from fastdeploy_r3.engine.tokenizer import Tokenizer
from fastdeploy_r3.outputs import RequestDelta, TextRule
from fastdeploy_r3.sampling_params import SamplingParams

SPLIT = list("aé€b".encode())  # a, C3 A9, E2 82 AC, b: two characters spelled by several tokens


def run(tokenizer: object, params: SamplingParams, steps: list[list[int]], detokenize_all: bool,
        abort_after: int | None = None, eos: tuple[int, ...] = ()) -> list[RequestDelta]:
    """The deltas one request produces, a step of `steps` at a time (aborted after `abort_after` steps)."""
    tp = TokenProcessor(ReleasingScheduler(), tokenizer, eos_token_ids=list(eos), max_model_len=1000,  # type: ignore[arg-type]
                        routing=None)
    tp.detokenize_all = detokenize_all
    groups = RequestGroups(tp, None)
    req = groups.fan_out("r", [1], params, None, "v0").children[0]
    deltas = []
    for i, step in enumerate(steps):
        if req.is_finished:
            break
        if i == abort_after:
            tp.finish(req, RequestStatus.FINISHED_ABORTED, message="client left")
        else:
            tp.append_tokens(req, step)
        deltas += groups.collect({"r"})
    return deltas


def texts(deltas: list[RequestDelta]) -> list[str]:
    return [c.text for d in deltas for c in d.outputs]


def received(tokenizer: object, params: SamplingParams, deltas: list[RequestDelta]) -> list[str]:
    detok = DeltaDetokenizer(tokenizer, params)
    return texts([detok.fill(d) for d in deltas])


@pytest.mark.parametrize("name, params, steps, abort_after, eos, expected", [
    ("length", SamplingParams(max_tokens=7), [[t] for t in SPLIT], None, (), ["a", "", "é", "", "", "€", "b"]),
    ("several tokens a step", SamplingParams(max_tokens=7), [SPLIT[:2], SPLIT[2:5], SPLIT[5:]], None, (),
     ["a", "é", "€b"]),
    ("length inside a character", SamplingParams(max_tokens=2), [[t] for t in SPLIT], None, (), ["a", "\ufffd"]),
    ("stop token trimmed", SamplingParams(max_tokens=20, stop_token_ids=[ord("!")]),
     [[t] for t in b"ok!x"], None, (), ["o", "k", ""]),
    ("stop token kept", SamplingParams(max_tokens=20, stop_token_ids=[ord("!")], include_stop_str_in_output=True),
     [[t] for t in b"ok!x"], None, (), ["o", "k", "!"]),
    ("eos in a step, after a split character", SamplingParams(max_tokens=20), [[0x61, 0xC3], [0xA9, 0x00, 0x62]],
     None, (0,), ["a", "é"]),
    ("aborted inside a character", SamplingParams(max_tokens=20), [[0x61], [0xE2, 0x82], [0]], 2, (),
     ["a", "", ""]),
])
def test_the_receiver_gives_the_engine_s_text(name: str, params: SamplingParams, steps: list[list[int]],
                                              abort_after: int | None, eos: tuple[int, ...],
                                              expected: list[str]) -> None:
    in_engine = run(ByteTokenizer(), params, steps, True, abort_after, eos)
    assert texts(in_engine) == expected, name
    left = run(ByteTokenizer(), params, steps, False, abort_after, eos)
    assert all(c.text == "" and c.text_rule is not TextRule.IN_TEXT for d in left for c in d.outputs)
    assert [c.token_ids for d in left for c in d.outputs] == [c.token_ids for d in in_engine for c in d.outputs]
    assert received(ByteTokenizer(), params, left) == expected, name


def test_requests_with_stop_strings_keep_their_text_in_the_engine() -> None:
    params = SamplingParams(max_tokens=20, stop=["k!"])
    deltas = run(ByteTokenizer(), params, [[t] for t in b"ok!x"], False)
    assert texts(deltas) == ["", "o", ""] and deltas[-1].outputs[0].stop_reason == "k!"
    assert all(c.text_rule is TextRule.IN_TEXT for d in deltas for c in d.outputs)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_fake_checkpoint_tokenizer_agrees_delta_for_delta(fake_model_dir: Callable[..., str],
                                                              skip_special_tokens: bool) -> None:
    """Real byte-level BPE: multi-token characters, a special token mid-stream, a length finish."""
    tok = Tokenizer(fake_model_dir("qwen3_moe"))
    ids = tok.encode("Grüße, 日本! The quick brown fox") + tok.encode("<|im_start|>") + tok.encode(" é")
    params = SamplingParams(max_tokens=len(ids), skip_special_tokens=skip_special_tokens)
    steps = [ids[i : i + 3] for i in range(0, len(ids), 3)]
    expected = texts(run(tok, params, steps, True))
    assert "".join(expected) == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert received(tok, params, run(tok, params, steps, False)) == expected
