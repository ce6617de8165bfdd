"""Logprobs, penalties and min_tokens through the offline LLM, against HF transformers on the same
fake checkpoint (float32, CPU): the engine's logprobs are log_softmax of HF's logits (divided by the
temperature for sampled tokens, raw for prompt tokens) to 1e-4, and penalised greedy decoding picks
exactly the tokens that HF's logits with the penalty rules applied pick.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from fastdeploy_r3 import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

PROMPT = "Hello world! Tell me a story"
TOL = 1e-4


class _HF:
    def __init__(self, model_dir: str) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """[T, V] float32 logits of every position of ids."""
        return self.model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "glm4_moe"])
def engine(request: pytest.FixtureRequest, fake_model_dir) -> Iterator[tuple[LLM, _HF]]:
    model_dir = fake_model_dir(request.param)
    with LLM(model_dir, block_size=4, num_gpu_blocks_override=64, max_num_seqs=4) as llm:
        yield llm, _HF(model_dir)


def _check_records(records, ref_lp: torch.Tensor, token_ids: list[int], num_top: int) -> None:
    """records[i] against ref_lp[i] [V]: chosen logprob, rank and the top-N ids and values."""
    assert len(records) == len(token_ids) == ref_lp.shape[0]
    for rec, tok, ref in zip(records, token_ids, ref_lp):
        assert rec.token_id == tok
        assert abs(rec.logprob - ref[tok].item()) < TOL, (rec.logprob, ref[tok].item())
        assert rec.rank == int((ref > ref[tok]).sum()) + 1
        top_lp, top_ids = ref.topk(num_top)
        assert [t for t, _ in rec.top] == top_ids.tolist()
        assert all(abs(a - b) < TOL for (_, a), b in zip(rec.top, top_lp.tolist()))


def test_greedy_and_prompt_logprobs_equal_hf_log_softmax(engine) -> None:
    """Greedy, 6 tokens, logprobs=3 and prompt_logprobs=2: every output token's record is HF's
    log_softmax at the position before it; prompt entry 0 is None, entry i scores prompt token i."""
    llm, hf = engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    comp, prompt = out.outputs[0], out.prompt_token_ids
    ref = torch.log_softmax(hf.logits(prompt + comp.token_ids), dim=-1)  # [P + N, V]
    p = len(prompt)
    _check_records(comp.logprobs, ref[p - 1 : p - 1 + len(comp.token_ids)], comp.token_ids, 3)
    assert all(rec.rank == 1 for rec in comp.logprobs)  # greedy takes the most likely token
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == p and out.prompt_logprobs[0] is None
    _check_records(out.prompt_logprobs[1:], ref[: p - 1], prompt[1:], 2)


@pytest.mark.parametrize("engine", ["qwen3_moe"], indirect=True)  # family-independent: one is enough
def test_sampled_logprobs_are_those_of_the_temperature_scaled_distribution(engine) -> None:
    """temperature 0.7, top_k 5 (truncation does not change the numbers): logprob = log_softmax(z / 0.7)."""
    llm, hf = engine
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=5, ignore_eos=True, logprobs=0)
    (out,) = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, params, use_tqdm=False)
    comp = out.outputs[0]
    ref = torch.log_softmax(hf.logits([5, 6, 7, 8, 9] + comp.token_ids) / 0.7, dim=-1)[4:-1]
    _check_records(comp.logprobs, ref, comp.token_ids, 0)
    assert all(rec.rank <= 5 for rec in comp.logprobs)


def _penalised_greedy(
    hf: _HF, prompt: list[int], n: int, rep: float, freq: float, pres: float
) -> tuple[list[int], int]:
    """The reference: HF logits, HF's RepetitionPenaltyLogitsProcessor over prompt + output, then the
    OpenAI frequency/presence formula over the output counts, then argmax. Also returns at how many
    steps the penalties changed the argmax."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    out: list[int] = []
    changed = 0
    for _ in range(n):
        raw = hf.logits(prompt + out)[-1:]  # [1, V]
        z = RepetitionPenaltyLogitsProcessor(rep)(torch.tensor([prompt + out]), raw.clone())
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=z.shape[-1]).float()
        z = z - freq * counts - pres * (counts > 0).float()
        out.append(int(z.argmax()))
        changed += int(z.argmax() != raw.argmax())
    return out, changed


def test_penalties_change_greedy_tokens_exactly_as_specified(engine) -> None:
    """The prompt ends with the model's own greedy continuation, so it wants to repeat itself. Two
    requests in one batch, no penalty vs repetition 2 + frequency 1 + presence 1: each gets exactly the
    reference's 10 tokens, and the penalties changed the argmax at some step."""
    llm, hf = engine
    seed = [11, 12, 13, 12, 11]
    prompt = seed + _penalised_greedy(hf, seed, 8, 1.0, 0.0, 0.0)[0] + seed
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    penalised = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=2.0,
                               frequency_penalty=1.0, presence_penalty=1.0)
    a, b = llm.generate([{"prompt_token_ids": prompt}, prompt], [plain, penalised], use_tqdm=False)
    assert a.outputs[0].token_ids == _penalised_greedy(hf, prompt, 10, 1.0, 0.0, 0.0)[0]
    ref, changed = _penalised_greedy(hf, prompt, 10, 2.0, 1.0, 1.0)
    assert b.outputs[0].token_ids == ref
    assert changed > 0 and a.outputs[0].token_ids != b.outputs[0].token_ids


@pytest.mark.parametrize("engine", ["qwen3_moe"], indirect=True)
def test_min_tokens_holds_back_stop_token_ids(engine) -> None:
    """The greedy 2nd token as stop_token_ids ends the plain request at 2 tokens; with min_tokens=5
    the stop token cannot be sampled before 5 tokens and the request runs to max_tokens or a later stop."""
    llm, _ = engine
    (ref,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    stop = ref.outputs[0].token_ids[1]
    if stop in ref.outputs[0].token_ids[:1]:
        pytest.fail(f"checkpoint changed: greedy tokens {ref.outputs[0].token_ids} repeat the stop id early")
    (early,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                   stop_token_ids=[stop]), use_tqdm=False)
    assert early.outputs[0].token_ids == ref.outputs[0].token_ids[:2]
    (held,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, min_tokens=5,
                                                  stop_token_ids=[stop]), use_tqdm=False)
    toks = held.outputs[0].token_ids
    assert len(toks) >= 5 and stop not in toks[:5]
    assert toks[0] == ref.outputs[0].token_ids[0]
