"""The slot formula: where the token at a position of a request lives, in the KV cache and in every
R3 row buffer addressed like it.

    block_table = [7, 2, 5]          block_size = 4
    position:  0 1 2 3 | 4 5 6 7 | 8 9 ...
    slot:     28 ..31  | 8 .. 11 | 20 21 ...      slot = block_table[p // bs] * bs + p % bs
"""

from __future__ import annotations

import numpy as np


def slots_of(block_table: list[int] | np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Slots [T] (int64) of the tokens at positions [T] of a request with this block table."""
    pos = np.asarray(positions, dtype=np.int64)  # [T]
    return np.asarray(block_table, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


def block_slots(block_ids: list[int] | np.ndarray, block_size: int) -> np.ndarray:
    """Every slot of the given blocks, block after block: [len(block_ids) * block_size]."""
    return slots_of(block_ids, np.arange(len(block_ids) * block_size), block_size)
