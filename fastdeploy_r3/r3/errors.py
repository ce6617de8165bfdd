"""What every R3 room shares: the fail-closed error and debug mode's stand-in rows (docs/architecture.md).

Numpy only, so that models, workers, the engine and the server may all import it.
"""

from __future__ import annotations

import numpy as np


class RoutingReplayError(RuntimeError):
    """R3 rows are missing, stale or corrupt; the request must fail rather than return them."""


def sentinel_of(dtype: np.dtype | str) -> int:
    """The "no route" value of a routing dtype: its max (never -1 in an unsigned array)."""
    return int(np.iinfo(np.dtype(dtype)).max)


def debug_rows(positions: np.ndarray, num_layers: int, top_k: int, dtype: np.dtype) -> np.ndarray:
    """Debug mode's stand-in for routing [T, L, K]: every id of the token at position p is p mod sentinel."""
    vals = (np.asarray(positions, dtype=np.int64) % sentinel_of(dtype)).astype(dtype)  # [T]
    return np.broadcast_to(vals[:, None, None], (len(vals), num_layers, top_k)).copy()
