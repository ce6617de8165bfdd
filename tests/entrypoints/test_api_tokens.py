"""Token ids, logprobs and the vLLM sampling extras through the real API server (subprocess, fake
Qwen3-MoE in float32) and the official `openai` client. Logprobs are checked against HF
transformers' log_softmax of the same model's logits on the ids the server returns, to 1e-4.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch
from api_server_process import ServerHandle, api_server

transformers = pytest.importorskip("transformers")

TOL = 1e-4
MODEL = "tiny-qwen"


@pytest.fixture(scope="module")
def model_dir(fake_model_dir) -> str:
    return fake_model_dir("qwen3_moe")


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory) -> Iterator[ServerHandle]:
    logs = str(tmp_path_factory.mktemp("logs"))
    with api_server(model_dir, logs, "--served-model-name", MODEL, "--max-model-len", "128") as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_log_softmax(model_dir: str):
    """ids -> [T, V] float32 log_softmax of HF's logits at every position (divided by temperature)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def run(ids: list[int], temperature: float = 1.0) -> torch.Tensor:
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float() / temperature, dim=-1)

    return run


def test_chat_logprobs_and_token_ids_equal_hf(client: openai.OpenAI, hf_log_softmax) -> None:
    """Chat, temperature 0.8, logprobs + top_logprobs=3 + return_token_ids: one logprob entry per
    returned token id, each equal to HF's log_softmax(logits / 0.8) at the position before it; the top
    3 are HF's top 3."""
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=6, temperature=0.8,
        seed=11, logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = resp.choices[0]
    prompt_ids, ids = resp.prompt_token_ids, choice.token_ids
    assert len(prompt_ids) == resp.usage.prompt_tokens and len(ids) == resp.usage.completion_tokens == 6
    content = choice.logprobs.content
    assert len(content) == 6
    ref = hf_log_softmax(prompt_ids + ids, temperature=0.8)[len(prompt_ids) - 1 : -1]  # [6, V]
    for entry, tok, row in zip(content, ids, ref):
        assert abs(entry.logprob - row[tok].item()) < TOL
        assert entry.bytes == list(entry.token.encode("utf-8"))
        top_lp, _ = row.topk(3)
        assert len(entry.top_logprobs) == 3
        assert max(abs(t.logprob - v) for t, v in zip(entry.top_logprobs, top_lp.tolist())) < TOL


def test_completion_echo_logprobs_cover_prompt_and_completion(client: openai.OpenAI, hf_log_softmax) -> None:
    """Completions, greedy, echo + logprobs=2: the text starts with the prompt, the logprob lists cover
    prompt + completion, the first entry is None, every other one is HF's (the chosen token and the
    best of its top entries; token texts may collide, e.g. byte tokens that decode alone to U+FFFD)."""
    resp = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=4, temperature=0,
                                     logprobs=2, echo=True, extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = resp.choices[0]
    assert resp.prompt_token_ids == choice.prompt_token_ids and len(choice.token_ids) == 4
    ids = resp.prompt_token_ids + choice.token_ids
    n = len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert choice.text.startswith("the quick brown fox")
    ref = hf_log_softmax(ids)
    for i in range(1, n):
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < TOL
        assert 1 <= len(lp.top_logprobs[i]) <= 3
        assert abs(max(lp.top_logprobs[i].values()) - ref[i - 1].max().item()) < TOL
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]


def test_streaming_carries_the_same_ids_and_logprobs(client: openai.OpenAI) -> None:
    """Chat streamed with logprobs and return_token_ids: the chunks' ids and logprobs, joined, equal
    the non-streamed answer's (logprobs to 1e-4); prompt_token_ids arrive on the first chunk."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0,
              logprobs=True, top_logprobs=1, extra_body={"return_token_ids": True, "ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    ids = [t for c in chunks if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])]
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert ids == full.choices[0].token_ids
    # the second request hits the prefix cache: same numbers up to float32 summation order
    want = [e.logprob for e in full.choices[0].logprobs.content]
    assert len(entries) == len(want) and all(abs(e.logprob - w) < TOL for e, w in zip(entries, want))
    assert chunks[0].prompt_token_ids == full.prompt_token_ids


def test_completion_stream_echoes_prompt_first(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="abc def", max_tokens=3, temperature=0, echo=True,
                                            logprobs=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text == "abc def"
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    streamed = [c for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum(len(c.choices[0].logprobs.tokens) for c in streamed) == len(chunks[0].choices[0].logprobs.tokens) + 3


def test_penalties_min_tokens_and_stop_options(client: openai.OpenAI) -> None:
    """Greedy on a prompt that repeats: penalties change the tokens; min_tokens keeps the first greedy
    token's stop id from ending the completion before 4 tokens; include_stop_str_in_output keeps it."""
    base = dict(model=MODEL, prompt=[30, 31, 30, 31, 30, 31], max_tokens=8, temperature=0)
    plain = client.completions.create(**base, extra_body={"return_token_ids": True, "ignore_eos": True})
    pen = client.completions.create(**base, presence_penalty=1.5, frequency_penalty=1.0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True,
                                                "repetition_penalty": 2.0})
    assert pen.choices[0].token_ids != plain.choices[0].token_ids
    first = plain.choices[0].token_ids[0]
    stopped = client.completions.create(**base, extra_body={"stop_token_ids": [first], "return_token_ids": True})
    assert stopped.choices[0].token_ids == [first] and stopped.choices[0].finish_reason == "stop"
    held = client.completions.create(**base, extra_body={"stop_token_ids": [first], "min_tokens": 4,
                                                         "return_token_ids": True, "ignore_eos": True})
    assert len(held.choices[0].token_ids) >= 4 and first not in held.choices[0].token_ids[:4]
    text = plain.choices[0].text
    windows = [text[i : i + 2] for i in range(len(text) - 1) if "\ufffd" not in text[i : i + 2]]
    assert windows, f"checkpoint changed: greedy text {text!r} has no two clean characters"
    stop = windows[0]
    cut = client.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True})
    kept = client.completions.create(**base, stop=[stop],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert cut.choices[0].finish_reason == "stop" and kept.choices[0].text == cut.choices[0].text + stop


def test_bad_logprob_requests_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"min_tokens": 3})
