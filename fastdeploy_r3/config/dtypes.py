"""The one map from a model dtype name (config, CLI, wire messages) to its torch dtype.

Names travel between processes as strings; each process turns them into torch dtypes here. torch
is imported on first use, so that the config and the API server can name dtypes without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MODEL_DTYPES = ("float32", "bfloat16", "float16")
# bytes per element of the dtypes a KV cache may hold, for the processes that size byte copies without
# importing torch (the cache transfer manager: a torch import costs ~3 s of CPU per process start)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def torch_dtype(name: str) -> torch.dtype:
    """'bfloat16' -> torch.bfloat16; refuses names outside MODEL_DTYPES, saying which are allowed."""
    if name not in MODEL_DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use one of {', '.join(MODEL_DTYPES)}")
    import torch

    return getattr(torch, name)
