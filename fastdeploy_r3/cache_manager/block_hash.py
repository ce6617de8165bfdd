"""Content addresses of full KV blocks: hash_i = H(hash_{i-1}, token ids of block i, extra keys).

The root is seeded with the model identity and the weight version, so a new checkpoint or a weight
update never hits KV (or R3 rows) computed by another.
"""

from __future__ import annotations

import struct

import xxhash


def root_hash(model_identity: str, weight_version: str) -> bytes:
    return xxhash.xxh3_128(f"fastdeploy_r3|{model_identity}|{weight_version}".encode()).digest()


def block_hash(parent: bytes, token_ids: list[int] | tuple[int, ...], extra_keys: bytes = b"") -> bytes:
    h = xxhash.xxh3_128()
    h.update(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(extra_keys)
    return h.digest()


def hash_block_chain(root: bytes, token_ids: list[int], block_size: int, num_blocks: int) -> list[bytes]:
    """Hashes of the first num_blocks full blocks of token_ids."""
    out: list[bytes] = []
    parent = root
    for i in range(num_blocks):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out
