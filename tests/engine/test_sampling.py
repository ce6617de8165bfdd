"""Sampling through the offline API on one tiny Qwen3-MoE engine: seeds, n, stop conditions, top-k,
ignore_eos and the progress bar. Facts of the fake checkpoint (seed 0) that a test relies on are
asserted first, so that a changed checkpoint fails loudly instead of making the test vacuous.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.sampling_params import InvalidRequestError

PROMPT = "Hello world!"
EOS_PROMPT = "The quick brown fox"  # greedy decoding of the fake checkpoint emits EOS after 3 tokens
EOS_ID = 511  # <|im_end|>


def greedy(max_tokens: int = 12, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def llm(qwen3_dir: str) -> Iterator[LLM]:
    with LLM(qwen3_dir, block_size=4, num_gpu_blocks_override=64, max_num_seqs=8) as llm:
        yield llm


@pytest.fixture(scope="module")
def greedy_ref(llm: LLM) -> list[int]:
    """12 greedy tokens of PROMPT, EOS ignored."""
    (out,) = llm.generate(PROMPT, greedy(ignore_eos=True), use_tqdm=False)
    return out.outputs[0].token_ids


def sample(llm: LLM, prompt: str = PROMPT, **kw: object) -> list[list[int]]:
    kw.setdefault("max_tokens", 12)
    kw.setdefault("ignore_eos", True)
    (out,) = llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)
    return [c.token_ids for c in out.outputs]


def test_same_seed_same_tokens_different_seed_different(llm: LLM) -> None:
    """temperature 1: seed 1 twice gives the same 12 tokens; seed 2 gives other tokens."""
    a = sample(llm, temperature=1.0, seed=1)
    assert sample(llm, temperature=1.0, seed=1) == a
    assert sample(llm, temperature=1.0, seed=2) != a  # 12 tokens over a 512 vocab: a collision is negligible


def test_seeded_request_is_reproducible_inside_a_batch(llm: LLM) -> None:
    """A seeded request gives the same tokens alone and batched with unseeded neighbours."""
    alone = sample(llm, temperature=1.0, seed=7)
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    ]
    outs = llm.generate(["Once upon a time", "What is", PROMPT], params, use_tqdm=False)
    assert [outs[2].outputs[0].token_ids] == alone


def test_n3_with_seed_gives_three_reproducible_completions(llm: LLM) -> None:
    """n=3, seed=5: three completions indexed 0..2, each of max_tokens, not all equal, same on a rerun."""
    (out,) = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    tokens = [c.token_ids for c in out.outputs]
    assert len({tuple(t) for t in tokens}) > 1
    assert sample(llm, n=3, temperature=1.0, seed=5, max_tokens=8) == tokens


def test_stop_token_ids_stop_there(llm: LLM, greedy_ref: list[int]) -> None:
    """stop_token_ids=[the 4th greedy token]: generation ends at its first occurrence, finish 'stop'."""
    stop_id = greedy_ref[3]
    k = greedy_ref.index(stop_id)
    (out,) = llm.generate(PROMPT, greedy(stop_token_ids=[stop_id], ignore_eos=True), use_tqdm=False)
    comp = out.outputs[0]
    assert comp.token_ids == greedy_ref[: k + 1]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop_id


def test_stop_string_truncates_text(llm: LLM) -> None:
    """A stop string taken from the greedy text: the text ends just before it, finish 'stop'."""
    (ref,) = llm.generate(PROMPT, greedy(ignore_eos=True), use_tqdm=False)
    text = ref.outputs[0].text
    match = re.search(r"[A-Za-z ]{3}", text[1:])  # plain ASCII, not at the very start
    assert match is not None, f"no ASCII run in the greedy text {text!r}"
    stop = match.group()
    (out,) = llm.generate(PROMPT, greedy(stop=[stop], ignore_eos=True), use_tqdm=False)
    comp = out.outputs[0]
    assert comp.text == text[: text.index(stop)]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.token_ids == ref.outputs[0].token_ids[: len(comp.token_ids)]


def test_max_tokens_finishes_with_length(llm: LLM, greedy_ref: list[int]) -> None:
    """max_tokens=3: exactly the first 3 greedy tokens, finish 'length'."""
    (out,) = llm.generate(PROMPT, greedy(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == greedy_ref[:3]
    assert out.outputs[0].finish_reason == "length"


def test_ignore_eos_runs_past_eos(llm: LLM) -> None:
    """EOS_PROMPT stops at EOS greedily; with ignore_eos it goes on to max_tokens through the EOS."""
    (out,) = llm.generate(EOS_PROMPT, greedy(max_tokens=8), use_tqdm=False)
    stopped = out.outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == EOS_ID and len(stopped.token_ids) < 8
    (out,) = llm.generate(EOS_PROMPT, greedy(max_tokens=8, ignore_eos=True), use_tqdm=False)
    ignored = out.outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 8
    assert ignored.token_ids[: len(stopped.token_ids)] == stopped.token_ids


def test_top_k_1_equals_greedy(llm: LLM, greedy_ref: list[int]) -> None:
    """top_k=1 at temperature 1 (no seed) keeps only the argmax: the greedy tokens."""
    assert sample(llm, temperature=1.0, top_k=1) == [greedy_ref]


def test_tqdm_bar_on_eight_prompts(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    """use_tqdm with 8 prompts draws a bar to 8/8 and returns the outputs in prompt order."""
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(8)]
    outs = llm.generate(prompts, greedy(max_tokens=2, ignore_eos=True), use_tqdm=True)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
    assert "8/8" in capsys.readouterr().err


def test_vllm_prompt_dicts_and_a_list_of_params(llm: LLM) -> None:
    """{"prompt_token_ids": ids} and {"prompt": text} prompts with one SamplingParams each give what
    the plain forms give, with prompt_token_ids in the outputs; logprobs only where asked."""
    ids = llm.tokenizer.encode(PROMPT)
    params = [greedy(max_tokens=4, ignore_eos=True, logprobs=2), greedy(max_tokens=4, ignore_eos=True)]
    a, b = llm.generate([{"prompt_token_ids": ids}, {"prompt": PROMPT}], params, use_tqdm=False)
    (ref,) = llm.generate(PROMPT, greedy(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert a.prompt_token_ids == b.prompt_token_ids == ids and b.prompt == PROMPT and a.prompt is None
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == ref.outputs[0].token_ids
    assert [r.token_id for r in a.outputs[0].logprobs] == a.outputs[0].token_ids
    assert all(len(r.top) == 2 for r in a.outputs[0].logprobs) and b.outputs[0].logprobs is None
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        llm.generate({"token_ids": ids}, use_tqdm=False)


def test_skip_special_tokens_false_keeps_eos_text(llm: LLM) -> None:
    """EOS_PROMPT with ignore_eos runs through <|im_end|>: it is in the text only with skip_special_tokens=False."""
    (out,) = llm.generate(EOS_PROMPT, greedy(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert EOS_ID in out.outputs[0].token_ids and "<|im_end|>" not in out.outputs[0].text
    (kept,) = llm.generate(EOS_PROMPT, greedy(max_tokens=6, ignore_eos=True, skip_special_tokens=False),
                           use_tqdm=False)
    assert kept.outputs[0].token_ids == out.outputs[0].token_ids and "<|im_end|>" in kept.outputs[0].text
