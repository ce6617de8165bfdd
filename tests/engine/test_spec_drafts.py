"""The n-gram drafter, where drafts go (assign_drafts' limits) and the speculative config's two spellings:
vLLM's --speculative-config JSON and SGLang's --speculative-algorithm flags."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from fastdeploy_r3.config import ConfigError, add_engine_args
from fastdeploy_r3.config.cli import _sglang_speculative
from fastdeploy_r3.config.speculative import SpeculativeConfig
from fastdeploy_r3.engine.request import Request
from fastdeploy_r3.engine.scheduler import ScheduledChunk
from fastdeploy_r3.engine.speculative import NgramDrafter, assign_drafts
from fastdeploy_r3.sampling_params import SamplingParams


def test_the_longest_suffix_n_gram_wins_and_its_first_occurrence_gives_the_drafts() -> None:
    d = NgramDrafter(1, 3)
    # suffix [2 3 4] occurred at 1..3, followed by 9 8; the 1-gram [4] also occurred later (followed by 5)
    assert d.propose([1, 2, 3, 4, 9, 8, 4, 5, 2, 3, 4], 2) == [9, 8]
    assert d.propose([1, 2, 3, 4, 9, 8, 4, 5, 2, 3, 4], 5) == [9, 8, 4, 5, 2]
    # no 3- or 2-gram repeats: the 1-gram [7] at index 1 -> [3 ...]
    assert d.propose([5, 7, 3, 1, 7], 3) == [3, 1, 7]
    # inside a run of one token the first occurrence leaves the longest continuation
    assert d.propose([4, 4, 4, 4, 4, 4], 3) == [4, 4, 4]
    assert d.propose([1, 2, 3], 3) == [] and d.propose([1], 3) == [] and d.propose([1, 2, 1], 0) == []


def test_prompt_lookup_min_bounds_the_shortest_n_gram() -> None:
    assert NgramDrafter(2, 3).propose([5, 7, 3, 1, 7], 3) == []  # only a 1-gram repeats
    assert NgramDrafter(2, 3).propose([5, 7, 3, 1, 5, 7], 3) == [3, 1, 5]


class _Fixed:
    def propose(self, token_ids: np.ndarray, max_drafts: int) -> list[int]:
        return [1, 2, 3, 4, 5][:max_drafts]


def _chunk(prompt_len: int, out: int, params: SamplingParams, computed: int | None = None) -> ScheduledChunk:
    r = Request("r", list(range(prompt_len)), params)
    r.output_token_ids = [0] * out
    r.num_computed_tokens = r.num_tokens - 1 if computed is None else computed
    return ScheduledChunk(r, r.num_tokens - r.num_computed_tokens)


def test_drafts_stop_at_max_tokens_the_model_length_and_the_step_budget() -> None:
    p = SamplingParams(max_tokens=10)
    c = _chunk(5, 7, p)  # 3 tokens left: 2 drafts and the bonus
    assert assign_drafts([c], _Fixed(), 4, 100, 64) == 2 and c.drafts == [1, 2]
    c = _chunk(5, 0, p)
    assert assign_drafts([c], _Fixed(), 4, 100, 7) == 1  # max_model_len 7: 2 tokens left
    a, b = _chunk(5, 0, p, computed=0), _chunk(5, 0, p)  # a prefill of 5 and a decode of 1: 6 of 9
    assert assign_drafts([a, b], _Fixed(), 4, 9, 64) == 3 and (a.drafts, b.drafts) == ([1, 2, 3], [])


def test_no_drafts_for_a_chunk_that_does_not_sample_or_a_request_with_penalties() -> None:
    part = _chunk(8, 0, SamplingParams(max_tokens=10), computed=0)
    part.num_new_tokens = 4  # a prefill chunk short of the last token
    pen = _chunk(5, 0, SamplingParams(max_tokens=10, repetition_penalty=1.2))
    assert assign_drafts([part, pen], _Fixed(), 3, 100, 64) == 0 and part.drafts == pen.drafts == []


def test_speculative_config_json_and_its_errors() -> None:
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 6}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (5, 1, 6)
    assert SpeculativeConfig.from_json(None) is None and SpeculativeConfig.from_json("{}") is None
    for bad, words in [
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0"),
        ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min=4"),
        ('{"method": "eagle3"}', "needs a separate draft model"),
        ('{"method": "lookahead"}', "unknown"),
        ('{"num_speculative_tokens": 3}', 'needs "method"'),
        ('{"method": "ngram", "k": 3}', "unknown speculative config key(s) k"),
        ("{method: ngram}", "not valid JSON"),
    ]:
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            SpeculativeConfig.from_json(bad)


def test_sglang_flags_map_onto_the_config() -> None:
    parser = add_engine_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", "m", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens",
                              "4", "--speculative-ngram-min-match-window-size", "2",
                              "--speculative-ngram-max-match-window-size", "5"])
    assert _sglang_speculative(args) == SpeculativeConfig("ngram", 3, 2, 5)
    for algorithm in ("EAGLE", "NEXTN"):  # SGLang's spellings for GLM-4.5's own draft layer
        args = parser.parse_args(["--model", "m", "--speculative-algorithm", algorithm,
                                  "--speculative-num-draft-tokens", "3"])
        assert _sglang_speculative(args) == SpeculativeConfig("mtp", 2)
    glm = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
           "--speculative-num-draft-tokens", "4"]  # SGLang's GLM-4.5 recipe
    assert _sglang_speculative(parser.parse_args(["--model", "m", *glm])) == SpeculativeConfig("mtp", 3)
    for argv, words in [
        (["--speculative-algorithm", "EAGLE", "--speculative-ngram-max-match-window-size", "3"], "for .* NGRAM"),
        (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4"], "only chains"),
        (["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "3"],
         "give 4"),
        (["--speculative-algorithm", "EAGLE3"], "not served here"),
        (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "1"], "use 2 or more"),
        (["--speculative-num-draft-tokens", "4"], "need --speculative-algorithm"),
        (["--speculative-algorithm", "NGRAM", "--speculative-config", '{"method": "ngram"}'], "not both"),
    ]:
        with pytest.raises(ConfigError, match=words):
            _sglang_speculative(parser.parse_args(["--model", "m", *argv]))


def test_llm_style_keyword_takes_the_json_and_a_dict(fake_model_dir) -> None:  # noqa: ANN001 - the fixture
    from fastdeploy_r3.config import EngineConfig

    model = fake_model_dir("qwen3_moe")
    a = EngineConfig.from_kwargs(model, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    b = EngineConfig.from_kwargs(model, speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert a.speculative_config == b.speculative_config == SpeculativeConfig("ngram", 2, 1, 4)
    assert EngineConfig.from_kwargs(model).speculative_config is None


def test_drafts_never_pass_the_lookahead_slots_the_workers_asked_for() -> None:
    """A runner that reserves 1 lookahead slot (WorkerReady.num_lookahead_tokens) gets 1 draft, whatever k."""
    from fastdeploy_r3.engine.speculative import Speculation

    spec = Speculation(SpeculativeConfig("ngram", 3, 1, 2), max_step_tokens=100, num_lookahead_tokens=1)
    c = _chunk(6, 0, SamplingParams(max_tokens=10))
    c.request.prompt_token_ids = [1, 2, 3, 1, 2, 3]
    spec.assign([c], max_model_len=64)
    assert c.drafts == [1] and spec.counters.verify_steps == 1


def test_token_histories_grow_with_the_request_and_follow_a_reused_id() -> None:
    from fastdeploy_r3.engine.speculative import TokenHistories

    h = TokenHistories()
    r = Request("x", [1, 2, 3], SamplingParams(max_tokens=200))
    assert h.of(r).tolist() == [1, 2, 3]
    r.output_token_ids += [4, 5]
    assert h.of(r).tolist() == [1, 2, 3, 4, 5]
    r.output_token_ids += list(range(100))  # past the first buffer
    assert h.of(r).tolist() == [1, 2, 3, 4, 5, *range(100)]
    again = Request("x", [9], SamplingParams(max_tokens=4))  # the id of a finished request, reused
    assert h.of(again).tolist() == [9]
    h.keep_only(set())
    assert h.of(r).tolist()[-3:] == [97, 98, 99]


def test_the_one_pass_lookup_agrees_with_a_brute_force_search() -> None:
    """Random short histories over 3 token ids (many repeats): the drafts equal a direct search for the
    longest suffix n-gram's first earlier occurrence."""
    import random

    def brute(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
        for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
            suffix = tokens[-n:]
            for i in range(len(tokens) - n):
                if tokens[i : i + n] == suffix:
                    return tokens[i + n : i + n + k]
        return []

    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
        lo, hi, k = rng.randrange(1, 4), rng.randrange(1, 6), rng.randrange(0, 4)
        hi = max(lo, hi)
        want = brute(tokens, lo, hi, k) if k else []
        assert NgramDrafter(lo, hi).propose(tokens, k) == want, (tokens, lo, hi, k)
        assert NgramDrafter(lo, hi).propose(np.array(tokens, dtype=np.int64), k) == want, (tokens, lo, hi, k)
