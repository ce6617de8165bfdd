"""Tokenizer of a model directory: tokenizer.json (HF `tokenizers`) + tokenizer_config.json."""

from __future__ import annotations

import json
import os
from typing import Any

from fastdeploy_r3.config import ConfigError


class Tokenizer:
    def __init__(self, model_dir: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ConfigError(f"{model_dir!r} has no tokenizer.json; pass token ids, or add a tokenizer")
        self._tok = HFTokenizer.from_file(path)
        cfg: dict[str, Any] = {}
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
        self.chat_template: str | None = cfg.get("chat_template")
        self.eos_token: str | None = _token_str(cfg.get("eos_token"))
        self.bos_token: str | None = _token_str(cfg.get("bos_token"))
        eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids = [eos_id] if eos_id is not None else []

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ConfigError("the model has no chat template; use /v1/completions or add one to tokenizer_config.json")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            eos_token=self.eos_token or "",
            bos_token=self.bos_token or "",
        )


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def load_tokenizer(model_dir: str) -> Tokenizer:
    return Tokenizer(model_dir)
