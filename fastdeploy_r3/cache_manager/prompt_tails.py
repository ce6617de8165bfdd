"""PD's partial last prompt block, on both sides of the prefill/decode boundary (docs/pd.md).

    prefill server  keep(rid, P)    as the request ends with its prompt computed, its partial last block
                                    (P mod block_size tokens) is saved: KVConnector.save_tail, under the
                                    chain hash of those tokens (never a full block's: fewer tokens)
    decode server   expect(rid, P)  the request continues that prompt: the block is looked up after the
                                    full ones, as a partial BlockKey (in P's room, or in the shared store)

The prefix cache manager owns the blocks; this only remembers which requests take part and names the
block. A partial block is never cached in the GPU or CPU pool: it fills up on D as D decodes.
"""

from __future__ import annotations

from fastdeploy_r3.cache_manager.block_hash import block_hash as chain_hash
from fastdeploy_r3.cache_manager.kv_connector import BlockKey


def partial_block_key(prompt: list[int], hashes: list[bytes], root: bytes, block_size: int) -> BlockKey:
    """The partial last block of `prompt`, whose full blocks hash to `hashes` (chained from `root`)."""
    tokens = tuple(prompt[len(hashes) * block_size :])
    return BlockKey(chain_hash(hashes[-1] if hashes else root, tokens), tokens, partial=True)


class PromptTails:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._keep: dict[str, int] = {}  # request id -> its prompt's length (prefill server)
        self._expect: dict[str, int] = {}  # request id -> the prompt's length P computed (decode server)

    def keep(self, request_id: str, num_prompt_tokens: int) -> None:
        """A prompt without a partial last block (a multiple of the block size, or 0: not asked) has none."""
        if num_prompt_tokens % self.block_size:
            self._keep[request_id] = num_prompt_tokens

    def expect(self, request_id: str, num_prompt_tokens: int) -> None:
        if num_prompt_tokens % self.block_size:
            self._expect[request_id] = num_prompt_tokens

    def expected_key(self, request_id: str, tokens: list[int], hashes: list[bytes], root: bytes) -> BlockKey | None:
        """The expected partial block of a request whose full blocks hash to `hashes`: right after them, and
        only when a token is left to compute after it (a decode server's request ends with P's first
        token; one P's token ended runs the prompt alone, and its last token must be computed)."""
        n = self._expect.get(request_id)
        if n is None or n >= len(tokens) or n // self.block_size != len(hashes):
            return None
        return partial_block_key(tokens[:n], hashes, root, self.block_size)

    def forget(self, request_id: str) -> int | None:
        """The request ended: the prompt length keep() noted for it, if any (its block is saved now)."""
        self._expect.pop(request_id, None)
        return self._keep.pop(request_id, None)
