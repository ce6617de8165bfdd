"""Large base64 payloads spliced into a JSON answer (entrypoints/payload_json.py) give exactly the bytes
json.dumps gives, whatever the text around them holds."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from fastdeploy_r3.entrypoints.payload_json import SplicedJson
from fastdeploy_r3.r3.codec import (
    decode_sglang_routed_experts,
    encode_sglang_routed_experts,
    sglang_routed_experts_b64,
)


def test_spliced_answers_equal_json_dumps_in_both_renderings() -> None:
    rows = [np.arange(24, dtype=np.uint8).reshape(2, 3, 4), np.full((1, 3, 4), 255, dtype=np.uint8)]
    payloads = [encode_sglang_routed_experts(r) for r in rows]
    # text that looks like JSON, quotes, unicode and a would-be placeholder of another process
    texts = ['a "quoted" {x}: 1', "fdr3-payload-0000-0 ünï"]

    def answers(values: list[str]) -> list[dict]:
        return [{"text": t, "meta_info": {"routed_experts": v, "id": i}} for i, (t, v) in enumerate(zip(texts, values))]

    for kwargs in ({"allow_nan": False}, {"ensure_ascii": False, "allow_nan": False, "separators": (",", ":")}):
        spliced = SplicedJson()
        held = [spliced.hold(p) for p in payloads]
        assert spliced.dumps(answers(held), **kwargs) == json.dumps(answers(payloads), **kwargs)
    got = json.loads(spliced.dumps(answers(held)))
    for answer, r in zip(got, rows):
        assert np.array_equal(decode_sglang_routed_experts(answer["meta_info"]["routed_experts"], 3, 4), r)


def test_answer_bytes_splice_payload_buffers_and_equal_the_text_encoded() -> None:
    """dumps_bytes (what /generate writes: the SSE event of a stream's last chunk, a whole answer) is the
    UTF-8 of prefix + dumps + suffix, payloads held as text, bytes or the encoder's memoryview alike."""
    rows = np.arange(3 * 48 * 8, dtype=np.uint8).reshape(3, 48, 8) % 128
    text_payload = encode_sglang_routed_experts(rows)
    for payload in (text_payload, text_payload.encode("ascii"), sglang_routed_experts_b64(rows)):
        spliced = SplicedJson()
        answer = {"text": "ünï \"q\"", "meta_info": {"routed_experts": spliced.hold(payload), "n": 1}}
        expected = {"text": "ünï \"q\"", "meta_info": {"routed_experts": text_payload, "n": 1}}
        for kwargs in ({"allow_nan": False}, {"ensure_ascii": False, "separators": (",", ":")}):
            got = spliced.dumps_bytes(answer, prefix="data: ", suffix="\n\n", **kwargs)
            assert got == f"data: {json.dumps(expected, **kwargs)}\n\n".encode()
            assert spliced.dumps(answer, **kwargs) == json.dumps(expected, **kwargs)


def test_a_held_payload_missing_from_the_answer_is_an_error_not_a_silent_drop() -> None:
    spliced = SplicedJson()
    spliced.hold("QUFB")
    with pytest.raises(ValueError, match="payload 0 was held but its placeholder is not in the answer"):
        spliced.dumps({"meta_info": {}})
    with pytest.raises(ValueError, match="payload 0 was held but its placeholder is not in the answer"):
        spliced.dumps_bytes({"meta_info": {}})
    assert SplicedJson().dumps({"a": [1, 2]}) == json.dumps({"a": [1, 2]})  # nothing held: plain json.dumps


def test_sglang_encoding_is_raw_little_endian_int32_for_every_dtype_and_empty_arrays() -> None:
    for dtype in (np.uint8, np.uint16, np.int32):
        a = np.arange(2 * 3 * 4, dtype=dtype).reshape(2, 3, 4)
        assert base64.b64decode(encode_sglang_routed_experts(a)) == a.astype("<i4").tobytes()
    assert encode_sglang_routed_experts(np.empty((0, 3, 4), dtype=np.uint8)) == ""


def test_openai_answers_and_chunks_splice_every_choice_payload_as_starlette_would_render_them() -> None:
    from starlette.responses import JSONResponse

    from fastdeploy_r3.entrypoints.payload_json import dumps_choices, json_answer

    body = {"id": "cmpl-1", "choices": [{"index": 0, "text": "naïve \"x\"", "routed_experts": "QUFBQQ=="},
                                        {"index": 1, "text": "", "routed_experts": None},
                                        {"index": 2, "text": "b", "routed_experts": "QkJC"}], "usage": {"a": 1}}
    assert json_answer(body).body == JSONResponse(body).body
    assert dumps_choices(body) == json.dumps(body)
    assert dumps_choices({"choices": [], "usage": None}) == json.dumps({"choices": [], "usage": None})
    assert body["choices"][0]["routed_experts"] == "QUFBQQ=="  # the caller's answer is left as it was
