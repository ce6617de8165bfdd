"""Tokenizer of a model directory, through `transformers.AutoTokenizer`, so that a checkpoint means what
it means to transformers: the chat template from tokenizer_config.json or chat_template.jinja, special
tokens added as the tokenizer's own config says, and tools handed to the template.

transformers is imported only when a tokenizer is built (it costs a second or more), never at module import.
"""

from __future__ import annotations

import os
from typing import Any

from fastdeploy_r3.errors import ConfigError

# any one of these makes a directory a tokenizer directory for AutoTokenizer
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class ChatTemplateError(ConfigError):
    """The chat template refused the messages (its own raise_exception) or could not be rendered."""


def check_tokenizer_dir(model_dir: str) -> str:
    """`model_dir` if it holds a tokenizer, else ConfigError: the check Tokenizer makes first, without
    importing transformers, so that a server refuses such a directory before it starts anything."""
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        raise ConfigError(
            f"{model_dir!r} has no tokenizer ({' / '.join(_TOKENIZER_FILES)}); pass token ids, or add a tokenizer"
        )
    return model_dir


class Tokenizer:
    def __init__(self, model_dir: str) -> None:
        check_tokenizer_dir(model_dir)
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"the tokenizer in {model_dir!r} cannot be loaded by transformers: {e}") from e
        eos_id = self._tok.eos_token_id
        self.eos_token_ids: list[int] = [] if eos_id is None else [int(eos_id)]

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added tokens included."""
        return len(self._tok)

    @property
    def chat_template(self) -> str | None:
        """The default chat template (chat_template.jinja or tokenizer_config.json's chat_template)."""
        template = self._tok.chat_template
        if isinstance(template, dict):  # named templates: "default" is the one used without a name
            template = template.get("default")
        return template or None

    @property
    def eos_token(self) -> str | None:
        return self._tok.eos_token

    @property
    def bos_token(self) -> str | None:
        return self._tok.bos_token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. add_special_tokens=True adds what the tokenizer's config says (a BOS for
        Llama-style tokenizers, nothing for Qwen's); pass False for text that already holds them, such as
        a rendered chat template (vLLM does the same for chat)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """transformers' decode; spaces_between_special_tokens is read by slow tokenizers only (fast ones
        join special tokens as their decoder says), as in SGLang and vLLM."""
        if spaces_between_special_tokens:
            return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                spaces_between_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text of `messages` (OpenAI-style dicts); `tools` (OpenAI tool specs) are handed to
        the template as transformers hands them. Encode the result with add_special_tokens=False."""
        if self.chat_template is None:
            raise ConfigError(
                "the model has no chat template; use /v1/completions, or add chat_template.jinja (or a "
                "chat_template entry in tokenizer_config.json) to the model directory"
            )
        from jinja2 import TemplateError

        try:
            return self._tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template refused these messages: {e}") from e


def load_tokenizer(model_dir: str) -> Tokenizer:
    return Tokenizer(model_dir)
