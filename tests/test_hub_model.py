"""`--model org/name` resolves through the Hugging Face cache, offline, as vLLM and SGLang do: a fake
cache laid out as huggingface_hub lays it out, HF_HUB_OFFLINE=1, no network."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from fastdeploy_r3.config.hub import resolve_model_path
from fastdeploy_r3.errors import ConfigError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _fake_cache(cache: str, repo_id: str, model_dir: str) -> str:
    """huggingface_hub's layout: models--org--name/{refs/main, snapshots/<commit>/<files>}."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(COMMIT)
    snapshot = os.path.join(repo, "snapshots", COMMIT)
    shutil.copytree(model_dir, snapshot)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> str:
    cache = str(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(fake_model_dir, offline_cache: str) -> None:
    snapshot = _fake_cache(offline_cache, "fake-org/tiny-glm", fake_model_dir("glm4_moe"))
    # huggingface_hub reads its settings at import: resolve in a fresh process, as a server would
    code = "from fastdeploy_r3.config.hub import resolve_model_path as r; print(r('fake-org/tiny-glm'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ}, check=True).stdout.strip()
    assert os.path.realpath(out) == os.path.realpath(snapshot)
    assert sorted(os.listdir(out)) == sorted(os.listdir(fake_model_dir("glm4_moe")))


def test_a_missing_hub_id_offline_says_how_to_get_it(offline_cache: str) -> None:
    code = "from fastdeploy_r3.config.hub import resolve_model_path as r; r('fake-org/not-downloaded')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "is not in the Hugging Face cache" in proc.stderr
    assert "hf download fake-org/not-downloaded" in proc.stderr


def test_a_directory_is_used_as_it_is_and_anything_else_is_refused(tmp_path) -> None:
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ConfigError, match="neither a directory nor a Hugging Face Hub id"):
        resolve_model_path("no/such/dir")
