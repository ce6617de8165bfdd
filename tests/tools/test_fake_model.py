"""Fake checkpoints: the tokenizer covers any text with exactly vocab_size ids; the CLI is a thin wrapper."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from fake_model import EOS_TOKEN, fake_hf_config

from fastdeploy_r3.config import ModelConfig

transformers = pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "glm4_moe"])
def test_tokenizer_matches_config_and_encodes_any_text(fake_model_dir, arch: str) -> None:
    d = fake_model_dir(arch)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    mc = ModelConfig(model=d)
    assert len(tok) == mc.vocab_size == 512
    assert mc.eos_token_ids == [tok.convert_tokens_to_ids(EOS_TOKEN)] == [tok.eos_token_id]
    text = "naïve café ✓ 日本語 🙂 \t\n <|im_start|> \x00"
    ids = tok(text)["input_ids"]
    assert all(0 <= i < mc.vocab_size for i in ids)
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_glm_tiny_preset_has_a_dense_first_layer() -> None:
    cfg = fake_hf_config("glm4_moe", "tiny")
    assert (cfg["first_k_dense_replace"], cfg["num_hidden_layers"], cfg["n_routed_experts"]) == (1, 4, 16)


def test_cli_writes_a_loadable_checkpoint(tmp_path) -> None:
    out = tmp_path / "cli"
    cmd = [sys.executable, os.path.join(REPO, "tools", "make_fake_model.py"), "--arch", "mixtral", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=str(tmp_path))
    with open(out / "config.json") as f:
        assert json.load(f)["architectures"] == ["MixtralForCausalLM"]
    assert ModelConfig(model=str(out)).moe_layer_ids == [0, 1, 2, 3]
