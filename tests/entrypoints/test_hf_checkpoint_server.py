"""The API server on a checkpoint written by transformers' save_pretrained (Mixtral: tied embeddings, a
tokenizer that adds <s>, chat_template.jinja), driven by the official `openai` client: a chat with tools
is the prompt transformers renders and tokenizes, its greedy answer is HF's, and a completion prompt gets
the tokenizer's <s>."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import openai
import pytest
import torch
import transformers
from api_server_process import api_server
from hf_checkpoints import BOS_ID, MOE_LAYER_IDS

from fastdeploy_r3.client import decode_routed_experts

MESSAGES = [{"role": "user", "content": "What is the weather like?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def model_dir(hf_checkpoint_dir) -> str:
    return hf_checkpoint_dir("mixtral")


@pytest.fixture(scope="module")
def client(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    logs = str(tmp_path_factory.mktemp("logs"))
    with api_server(model_dir, logs, "--routing-replay-config", '{"enable_routing_replay": true}',
                    "--served-model-name", "hf-mixtral") as handle:
        yield openai.OpenAI(base_url=f"{handle.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_with_tools_is_the_prompt_transformers_renders_and_answers_as_hf(client, model_dir: str) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True)["input_ids"]
    assert prompt[0] == BOS_ID and prompt.count(BOS_ID) == 1  # the template's <s>, not a second one
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        hf_out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=5)
    hf_text = tokenizer.decode(hf_out[0, len(prompt) :], skip_special_tokens=True)

    resp = client.chat.completions.create(model="hf-mixtral", messages=MESSAGES, tools=TOOLS, max_tokens=5,
                                          temperature=0)
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.choices[0].message.content == hf_text
    rows = decode_routed_experts(resp.choices[0].routed_experts)
    assert rows.shape == (len(prompt) + resp.usage.completion_tokens - 1, len(MOE_LAYER_IDS["mixtral"]), 2)
    assert np.all(rows < 8)


def test_completion_prompt_gets_the_tokenizers_bos(client, model_dir: str) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = "the quick brown fox"  # byte-level, no merges: one token a byte, plus <s>
    resp = client.completions.create(model="hf-mixtral", prompt=text, max_tokens=1, temperature=0)
    assert resp.usage.prompt_tokens == len(tokenizer(text)["input_ids"]) == 1 + len(text)
