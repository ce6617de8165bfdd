"""The mooncake backend's blocks on each side: P naming a prompt's blocks in its own store for its
outbox (keyed as its engine keys them, cache_manager/block_hash.py: the chain rooted at model
identity + weight version, under the storage namespace of its start-up weights, engine/builder.py), and
D naming the room its engine loads them from (P then writes them into the blocks D's engine reserved,
cache_manager/pd_receive.py) and handing it back once admitted.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from fastdeploy_r3.blobstore import open_blob_store
from fastdeploy_r3.blobstore.base import ChecksumError, stored_checksum
from fastdeploy_r3.blobstore.kv import KVStorageBackend, StorageError
from fastdeploy_r3.cache_manager.block_hash import hash_block_chain, root_hash
from fastdeploy_r3.cache_manager.prompt_tails import partial_block_key
from fastdeploy_r3.cache_manager.transfer import RemoteBlocks
from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.entrypoints.pd.handoff import Bootstrap
from fastdeploy_r3.entrypoints.pd.te_transfer import OutboxBlob, TeArena, TeError, fetch_manifest

logger = logging.getLogger(__name__)


class TeBlocks:
    def __init__(self, config: EngineConfig, arena: TeArena | None, store: KVStorageBackend | None = None) -> None:
        mc, cc = config.model_config, config.cache_config
        self.model_identity, self.block_size = mc.model_identity, cc.block_size
        self.transfer_timeout_s = cc.transfer_timeout_s
        self.arena = arena  # P's (its writes' source); None on D, whose CTM registers what it receives into
        if store is None and arena is not None:  # P reads its blocks from its store; D's engine has its own tier
            assert cc.kv_storage is not None  # check_pd_flags
            store = open_blob_store(cc.kv_storage, f"{mc.model_identity}|{mc.weight_version}", cc.storage_timeout_s,
                                    ttl_s=cc.kv_storage_ttl_s)
        self.store = store

    def keys(self, prompt_token_ids: list[int], weight_version: str) -> list[str]:
        """The store keys of the prompt's full blocks, then of its partial last block if it has one (as P's
        engine names it as the request ends: cache_manager/prompt_tails.py)."""
        root = root_hash(self.model_identity, weight_version)
        chain = hash_block_chain(root, prompt_token_ids, self.block_size, len(prompt_token_ids) // self.block_size)
        if len(prompt_token_ids) % self.block_size:
            chain.append(partial_block_key(prompt_token_ids, chain, root, self.block_size).block_hash)
        return [h.hex() for h in chain]

    async def read(self, prompt_token_ids: list[int], weight_version: str) -> tuple[list[OutboxBlob], int]:
        """P: the leading prompt blocks its store holds (a missing one ends the run: D computes from it), each
        read once for its size and trailer (the transfer reads it again: te_in_place.py), and how many tokens
        the last one holds when it is the prompt's partial last block (else 0)."""
        keys, store = self.keys(prompt_token_ids, weight_version), self.store
        tail_tokens = len(prompt_token_ids) % self.block_size
        assert store is not None  # a prefill server's

        def get(key: str) -> bytes | None:
            try:
                blob = store.get(key)
            except StorageError as e:
                logger.warning("cannot read block %s for the transfer: %s", key, e)
                return None
            return None if blob is None else bytes(blob)

        def scan() -> list[OutboxBlob]:
            out = []
            for k in keys:
                blob = get(k)
                try:
                    digest = None if blob is None else stored_checksum(blob)
                except ChecksumError as e:  # truncated: D would refuse it anyway, and compute from here
                    logger.warning("block %s in the store is no blob (%s); the transfer stops before it", k, e)
                    digest = None
                if blob is None or digest is None:
                    break
                out.append(OutboxBlob(len(blob), digest, functools.partial(get, k)))
            return out

        blobs = await asyncio.to_thread(scan)
        return blobs, tail_tokens if len(blobs) == len(keys) else 0

    async def remote(self, boot: Bootstrap, deadline: float) -> RemoteBlocks | None:
        """D: the room as the engine's remote source, P writing its blocks into the ones the engine reserves
        (cache_manager/pd_receive.py); None when P holds none or cannot say (the engine then
        computes the prompt). Its transfer is bounded well inside the CTM's own timeout."""
        import httpx

        from fastdeploy_r3.http_clients import async_client

        remaining = max(deadline - asyncio.get_running_loop().time(), 0.1)
        try:
            async with async_client(timeout=remaining) as client:
                m = await fetch_manifest(client, boot.host, boot.port, boot.room)
        except (httpx.HTTPError, ValueError, TeError) as e:
            logger.warning("room %d: no blocks from the prefill server (%s); computing the prompt here", boot.room, e)
            return None
        if not m.block_digests:
            return None
        return RemoteBlocks(boot.host, boot.port, boot.room, m.blob_nbytes, tuple(m.block_digests),
                            tail_tokens=m.tail_tokens, timeout_s=min(remaining, self.transfer_timeout_s / 2))

    async def release(self, boot: Bootstrap) -> None:
        """D, once its engine admitted the request: P drops the room from its outbox. The engine took
        only the blocks its GPU pool lacked (maybe none), and an outbox full of rooms nobody will pull
        would push out the rooms others still need. Best effort: a room already taken is a no-op."""
        import httpx

        from fastdeploy_r3.http_clients import async_client

        try:
            async with async_client(timeout=5.0) as client:
                await client.delete(f"http://{boot.host}:{boot.port}/pd/rooms/{boot.room}/kv")
        except httpx.HTTPError as e:
            logger.info("room %d: the prefill server did not take back its room (%s); it expires there", boot.room, e)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
        if self.store is not None:
            self.store.close()
