"""A streamed /generate chunk grown delta by delta (entrypoints/native/stream_chunks.py) is, byte for
byte, the JSON of the whole answer so far encoded afresh: for texts that need escaping (quotes,
backslashes, control characters, non-ASCII, astral characters), logprobs of -inf (the floor) and of
every magnitude, top logprobs with token text, entropies, weight-version spans and empty deltas."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from fastdeploy_r3.entrypoints.native import serving_generate
from fastdeploy_r3.entrypoints.native.serving_generate import NativeServing, _Item
from fastdeploy_r3.entrypoints.openai.serving_engine import engine_error
from fastdeploy_r3.entrypoints.payload_json import SplicedJson
from fastdeploy_r3.logprobs import TokenLogprob
from fastdeploy_r3.outputs import CompletionDelta, OutputAssembler, RequestDelta, WeightVersionSpan
from fastdeploy_r3.sampling_params import SamplingParams

PIECES = ["a", " the", '"', "\\", "\n", "\t\x01", "é", "日本", "😀", "", "</s>", "\u2028"]


class _Tokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return PIECES[ids[0] % len(PIECES)]


def _serving() -> NativeServing:
    return NativeServing(SimpleNamespace(engine=SimpleNamespace(tokenizer=_Tokenizer())))


def _record(rng: random.Random, token_id: int, top: int, entropy: bool) -> TokenLogprob:
    lp = rng.choice([float("-inf"), -1e-9, -0.5, -3.25, -123456.789, -1e-300, 0.0, -2 / 3])
    tops = [(rng.randrange(1000), rng.choice([-0.1, float("-inf"), -7.0 / 3])) for _ in range(top)]
    return TokenLogprob(token_id, lp, 1, tops, entropy=rng.random() * 5 if entropy else None)


def _deltas(rng: random.Random, n: int, logprobs: bool, top: int, entropy: bool) -> list[RequestDelta]:
    out = []
    for i in range(n):
        ids = [rng.randrange(100000) for _ in range(rng.choice([0, 1, 1, 1, 3]))]
        spans = [WeightVersionSpan("v1", 0, 3)] + ([WeightVersionSpan("v2", 3, 9)] if i > n // 2 else [])
        c = CompletionDelta(index=0, text="".join(rng.choice(PIECES) for _ in range(len(ids))), token_ids=ids,
                            logprobs=[_record(rng, t, top, entropy) for t in ids] if logprobs else None,
                            weight_versions=spans, spans_weight_versions=i > n // 2)
        out.append(RequestDelta("r", [c], False, prompt_token_ids=[1, 2, 3] if i == 0 else None,
                                num_cached_tokens=2))
    return out


@pytest.mark.parametrize(("logprobs", "top", "entropy", "with_text"),
                         [(False, 0, False, False), (True, 0, False, False), (True, 3, True, True),
                          (False, 0, True, False)])
def test_every_chunk_is_the_bytes_of_the_answer_so_far_encoded_afresh(logprobs, top, entropy, with_text,
                                                                     monkeypatch) -> None:
    monkeypatch.setattr(serving_generate, "time", SimpleNamespace(monotonic=lambda: 1001.5))  # e2e_latency 1.5
    serving = _serving()
    params = SamplingParams(max_tokens=100, logprobs=top if logprobs else None, return_entropy=entropy)
    item = _Item("r", [1, 2, 3], None, params, logprobs, with_text, 1)
    for seed in range(8):
        rng = random.Random(seed)
        assembler, so_far = OutputAssembler("r"), serving.cumulative_json(item)
        for delta in _deltas(rng, 40, logprobs, top, entropy):
            assembler.add(delta)
            so_far.add(delta.outputs[0], engine_error)
            if so_far.last is None:
                continue
            whole = assembler.output()
            want = json.dumps(serving.result(item, whole, whole.outputs[0], 1000.0, None), allow_nan=False)
            spliced = SplicedJson()
            chunk = serving.answer(item, 1, len(assembler.prompt_token_ids), assembler.num_cached_tokens,
                                   so_far.last, so_far.num_tokens, 1000.0, so_far.fields(spliced), None)
            got = spliced.dumps_bytes(chunk, prefix="data: ", suffix="\n\n", allow_nan=False)
            assert got == f"data: {want}\n\n".encode()
        assert so_far.num_tokens == len(assembler.output().outputs[0].token_ids)


def test_a_delta_whose_logprobs_do_not_match_its_tokens_is_an_engine_error() -> None:
    serving = _serving()
    item = _Item("r", [1], None, SamplingParams(max_tokens=4, logprobs=0), True, False, 1)
    so_far = serving.cumulative_json(item)
    with pytest.raises(Exception, match="sent 0 logprobs for 2 tokens"):
        so_far.add(CompletionDelta(index=0, text="ab", token_ids=[5, 6], logprobs=[]), engine_error)


def test_raw_json_replaces_its_quoted_placeholder_and_text_payloads_theirs() -> None:
    spliced = SplicedJson()
    obj = {"a": spliced.hold_raw("[1, 2]"), "b": spliced.hold("QUJD"), "c": spliced.hold_raw('"x\\"y"')}
    assert spliced.dumps_bytes(obj) == b'{"a": [1, 2], "b": "QUJD", "c": "x\\"y"}'
    assert spliced.dumps(obj) == '{"a": [1, 2], "b": "QUJD", "c": "x\\"y"}'
