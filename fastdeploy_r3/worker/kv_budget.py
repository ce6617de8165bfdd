"""How many KV blocks the device pool gets: what the memory budget holds, capped by what the engine can
ever use.

A small model on a large GPU would otherwise get tens of millions of blocks (a 2-layer test model on an
H200: ~2 KB per block, ~120 GB free), and the engine keeps per-block bookkeeping on the host (the block
pool, the routing rows' host buffer of slots x layers x top-k, the block hash chain): starting such an
engine took minutes and gigabytes of host memory for blocks no request could ever fill. The cap is
every running sequence at full length, times a headroom for prefix-cache reuse (finished requests' blocks
stay cached until evicted), and never more than MAX_BLOCKS.
"""

from __future__ import annotations

PREFIX_CACHE_HEADROOM = 4  # cached blocks kept beyond what the running sequences hold, as a multiple
MAX_BLOCKS = 1 << 20  # host bookkeeping stays at a few seconds and a few hundred MB at most


def usable_blocks(max_num_seqs: int, max_model_len: int | None, block_size: int) -> int:
    """The most blocks the engine can put to use: full-length sequences x headroom, at most MAX_BLOCKS."""
    if max_model_len is None:
        return MAX_BLOCKS
    per_seq = -(-max_model_len // block_size)
    return min(MAX_BLOCKS, max_num_seqs * per_seq * PREFIX_CACHE_HEADROOM)


def num_kv_blocks(budget_bytes: float, bytes_per_block: int, cap: int) -> int:
    """Blocks the memory budget holds, capped; below 2 the caller refuses to start."""
    return min(cap, int(budget_bytes // bytes_per_block))
