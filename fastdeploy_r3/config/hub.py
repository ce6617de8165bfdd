"""`--model` as a Hugging Face Hub id (`Qwen/Qwen3-30B-A3B`), resolved the way vLLM and SGLang do:
through huggingface_hub's cache, so `HF_HUB_OFFLINE=1` serves a model downloaded earlier without
touching the network, and a local directory is used as it is.

Only the files the engine reads are fetched: config and generation config, safetensors (and their
index), and the tokenizer's files.
"""

from __future__ import annotations

import os
import re

from fastdeploy_r3.errors import ConfigError

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


def resolve_model_path(model: str, revision: str | None = None) -> str:
    """The local directory of `model`: itself when it is one, else the Hub snapshot in the cache
    (downloaded unless HF_HUB_OFFLINE is set). ConfigError says which of the two it is not."""
    if os.path.isdir(model):
        return model
    if not _HUB_ID.fullmatch(model):
        raise ConfigError(f"--model {model!r} is neither a directory nor a Hugging Face Hub id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id=model, revision=revision, allow_patterns=MODEL_FILES)
    except LocalEntryNotFoundError as e:
        raise ConfigError(f"--model {model!r} is not in the Hugging Face cache and cannot be downloaded now "
                          f"(offline, or no network): download it once with `hf download {model}`, or pass a "
                          "directory") from e
    except (HfHubHTTPError, OSError) as e:
        raise ConfigError(f"--model {model!r} could not be fetched from the Hugging Face Hub: {e}") from e
