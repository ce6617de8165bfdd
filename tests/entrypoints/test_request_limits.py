"""The bounds the server checks before a request costs anything (issue 11, F2), as units."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from fastdeploy_r3.entrypoints.openai.request_limits import (
    FALLBACK_LONGEST_TOKEN_CHARS,
    BodySizeLimit,
    PromptCharBound,
    longest_token_chars,
)


class VocabTokenizer:
    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "Ġthe": 1, "<|im_start|>": 2, "ĠĠĠĠĠĠĠĠ": 3}


def test_the_longest_vocabulary_entry_bounds_what_a_token_covers() -> None:
    assert longest_token_chars(VocabTokenizer()) == len("<|im_start|>") == 12
    assert longest_token_chars(object()) == FALLBACK_LONGEST_TOKEN_CHARS  # no vocabulary to read


def test_prompt_char_bound_is_max_model_len_times_the_longest_token() -> None:
    bound = PromptCharBound(max_model_len=100, longest_token_chars=12)
    assert bound.max_chars == 1200 and bound.check(1200) is None
    assert bound.check(1201) == ("the prompt has 1201 characters, more than the 100 tokens of max_model_len can "
                                 "hold (at most 1200 characters); shorten the prompt")


class Body(BaseModel):
    prompt: str


def _app(limit: int) -> TestClient:
    app = FastAPI()

    @app.post("/echo")
    async def echo(body: Body) -> dict:
        return {"chars": len(body.prompt)}

    app.add_middleware(BodySizeLimit, max_bytes=limit)
    return TestClient(app)


def test_body_size_limit_by_content_length_and_by_counting_a_chunked_body() -> None:
    client = _app(limit=1000)
    assert client.post("/echo", json={"prompt": "x" * 900}).json() == {"chars": 900}
    r = client.post("/echo", json={"prompt": "x" * 1000})
    assert r.status_code == 413 and "larger than 0.000953674 MiB" in r.json()["error"]["message"]
    chunked = client.post("/echo", content=(b'{"prompt": "' + b"y" * 300 for _ in range(5)),
                          headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413
