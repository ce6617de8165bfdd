"""The engine serves checkpoints written by the installed transformers' save_pretrained
(tests/hf_checkpoints.py), for all three families: a chat prompt rendered from chat_template.jinja, greedy
tokens equal to HF `generate` (float32, stopping at generation_config.json's eos ids), and R3 rows equal
to HF's router top-k of the same tokens; a call without sampling params samples with the checkpoint's
generation_config.json defaults."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
import transformers
from hf_checkpoints import BOS_ID, FAMILIES, GENERATION_DEFAULTS, MOE_LAYER_IDS

from fastdeploy_r3 import LLM, SamplingParams
from fastdeploy_r3.outputs import RequestOutput

MESSAGES = [{"role": "user", "content": "Tell me a story about the experts."}]
MAX_TOKENS = 6


class _Served:
    """One family: our engine (R3 in the response) and transformers' model on the same directory."""

    def __init__(self, family: str, model_dir: str) -> None:
        self.family = family
        self.llm = LLM(model=model_dir, block_size=4, routing_replay_config={"enable_routing_replay": True})
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)

    def chat_ids(self) -> list[int]:
        tok = self.llm.tokenizer
        return tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)

    def hf_greedy(self, prompt_ids: list[int]) -> list[int]:
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS)
        return out[0, len(prompt_ids) :].tolist()

    def hf_router_topk(self, ids: list[int]) -> np.ndarray:
        """[T, L, K] sorted expert ids of HF's routers (forward hooks on each MoE block's gate)."""
        captured: dict[int, torch.Tensor] = {}
        handles = []
        for name, module in self.hf.named_modules():
            if name.endswith(".mlp.gate") and type(module).__name__.lower().endswith("topkrouter"):
                layer = int(name.split(".")[2])
                handles.append(module.register_forward_hook(lambda m, a, o, i=layer: captured.__setitem__(i, o[2])))
        try:
            with torch.no_grad():
                self.hf(torch.tensor([ids]))
        finally:
            for h in handles:
                h.remove()
        assert sorted(captured) == MOE_LAYER_IDS[self.family]
        return np.stack([captured[i].sort(dim=-1).values.numpy() for i in sorted(captured)], axis=1)


@pytest.fixture(scope="module", params=FAMILIES)
def served(request: pytest.FixtureRequest, hf_checkpoint_dir) -> Iterator[_Served]:
    s = _Served(request.param, hf_checkpoint_dir(request.param))
    try:
        yield s
    finally:
        s.llm.shutdown()


def test_chat_prompt_comes_from_chat_template_jinja(served: _Served) -> None:
    """The template transformers saved to chat_template.jinja renders the prompt; Mixtral's writes its BOS."""
    text = served.llm.tokenizer.apply_chat_template(MESSAGES)
    bos = "<s>" if served.family == "mixtral" else ""
    assert text == f"{bos}<|im_start|>user\nTell me a story about the experts.<|im_end|>\n<|im_start|>assistant\n"
    hf_ids = served.hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert served.chat_ids() == hf_ids


def test_greedy_chat_and_r3_equal_hf(served: _Served) -> None:
    prompt = served.chat_ids()
    out: RequestOutput = served.llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    completion = out.outputs[0].token_ids
    assert completion == served.hf_greedy(prompt)
    assert len(set(completion)) > 1, f"greedy output collapsed to one token: {completion}"

    rows = out.outputs[0].routed_experts  # [P + N - 1, L, K]
    assert out.moe_layer_ids == MOE_LAYER_IDS[served.family]
    assert rows.shape[:2] == (len(prompt) + len(completion) - 1, len(MOE_LAYER_IDS[served.family]))
    want = served.hf_router_topk((prompt + completion)[:-1])
    np.testing.assert_array_equal(np.sort(rows.astype(np.int64), axis=-1), want)


def test_text_prompt_gets_the_special_tokens_its_tokenizer_adds(served: _Served) -> None:
    """A completion prompt is encoded as transformers encodes it: Mixtral's tokenizer adds <s>, the others nothing."""
    out = served.llm.generate("the quick brown fox", SamplingParams(temperature=0, max_tokens=1))[0]
    assert out.prompt_token_ids == served.hf_tokenizer("the quick brown fox")["input_ids"]
    assert (out.prompt_token_ids[0] == BOS_ID) is (served.family == "mixtral")


def test_no_sampling_params_means_generation_config_defaults(served: _Served, monkeypatch) -> None:
    """generation_config.json says temperature 0.7, top_p 0.9, top_k 20: what vLLM's LLM.generate samples with."""
    seen: list[SamplingParams] = []
    add = served.llm.engine.add_request

    def spy(request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kw: object) -> object:
        seen.append(params)
        return add(request_id, prompt_token_ids, params, **kw)

    monkeypatch.setattr(served.llm.engine, "add_request", spy)
    served.llm.generate([5, 6, 7])
    assert {k: getattr(seen[0], k) for k in GENERATION_DEFAULTS} == GENERATION_DEFAULTS
