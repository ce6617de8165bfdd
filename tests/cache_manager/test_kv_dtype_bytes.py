"""The cache transfer manager sizes KV byte copies from dtype names without importing torch
(config/dtypes.DTYPE_BYTES): the table must agree with torch, and the CPU CTM must stay torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fastdeploy_r3.cache_manager.transfer import KVCacheSpec
from fastdeploy_r3.config.dtypes import DTYPE_BYTES


@pytest.mark.parametrize("name", sorted(DTYPE_BYTES))
def test_the_table_agrees_with_torch(name: str) -> None:
    assert DTYPE_BYTES[name] == torch.empty((), dtype=getattr(torch, name)).element_size()


def test_an_unknown_kv_dtype_is_refused_by_name() -> None:
    spec = KVCacheSpec(name="kv", shape=(2, 2, 4, 4, 2, 16), dtype="int4", device="cpu")
    with pytest.raises(TypeError, match="'int4' is not a KV cache dtype; use one of float32"):
        _ = spec.itemsize


def test_the_cpu_cache_transfer_manager_imports_no_torch() -> None:
    code = ("import sys, fastdeploy_r3.cache_manager.cache_transfer_manager, fastdeploy_r3.cache_manager.kv_tiers; "
            "print('torch' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
