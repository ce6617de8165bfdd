"""R3 as the trainer's tensor type: numpy, torch or Paddle, without a copy where the dtype allows.

Gather ops take int32 or int64 indices (Paddle's `take_along_axis`/`gather`, torch's `gather` wants
int64), while the server sends the narrowest dtype that holds the expert ids (uint8 for <= 255
experts). So unsigned ids are widened to int32 (a copy); int32/int64 arrays are shared with the
framework through DLPack (Paddle) or `from_numpy` (torch). The "no route" sentinel (the dtype's max)
would turn into a valid-looking id after widening, so it is refused here, as in the Megatron layout.
"""

from __future__ import annotations

from typing import Any

import numpy as np

FRAMEWORKS = ("numpy", "torch", "paddle")


def _gatherable(arr: np.ndarray) -> np.ndarray:
    """int32/int64 as they are; other integer ids widened to int32 after a sentinel check."""
    if arr.dtype.kind not in "iu":
        raise TypeError(f"R3 holds {arr.dtype}, not integer expert ids")
    if arr.dtype in (np.int32, np.int64):
        return np.ascontiguousarray(arr)
    if arr.dtype.kind == "u" and arr.size:
        holes = np.argwhere(arr == np.iinfo(arr.dtype).max)
        if len(holes):
            raise ValueError(f"R3 position {tuple(int(i) for i in holes[0])} holds the no-route sentinel")
    if arr.size and int(arr.max()) > np.iinfo(np.int32).max:
        raise ValueError("R3 expert ids do not fit int32")
    return arr.astype(np.int32)


def as_tensor(arr: np.ndarray, framework: str = "numpy") -> Any:
    """`[rows, L, K]` (or any shape) of expert ids -> int32/int64 array of `framework` on the CPU.

    `framework`: "numpy", "torch" or "paddle" (needs `pip install fastdeploy_r3[paddle]`). The result
    shares memory with `arr` when `arr` is already int32/int64 and C-contiguous.
    """
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework={framework!r}; use one of {FRAMEWORKS}")
    ids = _gatherable(arr)
    if framework == "numpy":
        return ids
    if not ids.flags.writeable:  # e.g. a view of received bytes: the frameworks want memory they may write
        ids = ids.copy()
    if framework == "torch":
        import torch

        return torch.from_numpy(ids)
    try:
        import paddle
    except ImportError as e:
        raise ImportError(f"framework='paddle' needs PaddlePaddle ({e}); pip install fastdeploy_r3[paddle]") from e
    return paddle.from_dlpack(ids)
