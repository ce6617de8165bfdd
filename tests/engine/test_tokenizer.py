"""The engine's Tokenizer is transformers' AutoTokenizer on the model directory: the chat template from
chat_template.jinja or from tokenizer_config.json, tools handed to the template, special tokens added as
the tokenizer says, errors that say what to do; and importing the module does not import transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hf_checkpoints import BOS_ID, CHAT_TEMPLATE, EOS_ID, VOCAB_SIZE, save_tokenizer

from fastdeploy_r3.config import ConfigError
from fastdeploy_r3.engine.tokenizer import ChatTemplateError, Tokenizer

USER = [{"role": "user", "content": "hi"}]
CHATML = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture
def tokenizer_dir(tmp_path) -> str:
    """A Qwen-style tokenizer as transformers saves it: tokenizer.json, tokenizer_config.json, chat_template.jinja."""
    save_tokenizer("qwen3_moe", str(tmp_path))
    assert os.path.isfile(tmp_path / "chat_template.jinja")
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    return str(tmp_path)


def test_chat_template_is_read_from_chat_template_jinja(tokenizer_dir: str) -> None:
    tok = Tokenizer(tokenizer_dir)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.apply_chat_template(USER) == CHATML
    assert tok.apply_chat_template(USER, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_chat_template_is_read_from_tokenizer_config_json(tokenizer_dir: str) -> None:
    """The older layout (transformers < 4.43 and many Hub models): the template inside tokenizer_config.json."""
    os.remove(os.path.join(tokenizer_dir, "chat_template.jinja"))
    path = os.path.join(tokenizer_dir, "tokenizer_config.json")
    cfg = json.load(open(path))
    with open(path, "w") as f:
        json.dump({**cfg, "chat_template": CHAT_TEMPLATE}, f)
    assert Tokenizer(tokenizer_dir).apply_chat_template(USER) == CHATML


def test_tools_reach_the_template(tokenizer_dir: str) -> None:
    text = Tokenizer(tokenizer_dir).apply_chat_template(USER, tools=[WEATHER_TOOL])
    assert text == "<|im_start|>system\nTools: get_weather<|im_end|>\n" + CHATML


def test_template_refusal_is_a_typed_error(tokenizer_dir: str) -> None:
    with pytest.raises(ChatTemplateError, match="refused these messages: a tool message cannot come first"):
        Tokenizer(tokenizer_dir).apply_chat_template([{"role": "tool", "content": "42"}])


def test_no_chat_template_says_where_to_put_one(tokenizer_dir: str) -> None:
    os.remove(os.path.join(tokenizer_dir, "chat_template.jinja"))
    with pytest.raises(ConfigError, match="add chat_template.jinja"):
        Tokenizer(tokenizer_dir).apply_chat_template(USER)


def test_special_tokens_are_added_as_the_tokenizer_says(tmp_path) -> None:
    """Mixtral-style: the saved tokenizer adds <s>; a rendered chat prompt is encoded without adding it again."""
    save_tokenizer("mixtral", str(tmp_path))
    tok = Tokenizer(str(tmp_path))
    assert tok.encode("hi") == [BOS_ID, 71, 72]
    assert tok.encode("hi", add_special_tokens=False) == [71, 72]
    chat = tok.apply_chat_template(USER)
    assert chat == "<s>" + CHATML
    assert tok.encode(chat, add_special_tokens=False).count(BOS_ID) == 1


def test_decode_vocab_and_eos(tokenizer_dir: str) -> None:
    tok = Tokenizer(tokenizer_dir)
    ids = tok.encode("ü 日本<|im_end|>")
    assert ids[-1] == EOS_ID
    assert tok.decode(ids) == "ü 日本"
    assert tok.decode(ids, skip_special_tokens=False) == "ü 日本<|im_end|>"
    assert tok.vocab_size == VOCAB_SIZE and tok.eos_token_ids == [EOS_ID]


def test_a_directory_without_tokenizer_files_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="has no tokenizer .*pass token ids, or add a tokenizer"):
        Tokenizer(str(tmp_path))


def test_importing_the_module_does_not_import_transformers() -> None:
    code = "import sys, fastdeploy_r3.engine.tokenizer; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
