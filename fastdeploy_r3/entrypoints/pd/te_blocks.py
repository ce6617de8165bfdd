"""The mooncake backend's blocks on each side: the store keys of a prompt's full blocks, P reading them
from its own store into its outbox, D storing what arrived over the transfer engine into its own.

Both servers key a block as their engines do (cache_manager/block_hash.py: the chain rooted at model
identity + weight version) under the storage namespace of their start-up weights (engine/builder.py),
so a block D stores here is the very block its engine's storage lookup finds. A weight update under
the same name with a forced reload roots the engine's chain elsewhere: D's engine then misses these
blocks and computes the prompt (exact, only slower).
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastdeploy_r3.blobstore import open_blob_store
from fastdeploy_r3.blobstore.kv import KVStorageBackend, StorageError
from fastdeploy_r3.cache_manager.block_hash import hash_block_chain, root_hash
from fastdeploy_r3.cache_manager.transfer import RemoteBlocks
from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.entrypoints.pd.handoff import Bootstrap
from fastdeploy_r3.entrypoints.pd.te_transfer import TeArena, TeError, fetch_manifest, pull_room

logger = logging.getLogger(__name__)


class TeBlocks:
    def __init__(self, config: EngineConfig, arena: TeArena | None, store: KVStorageBackend | None = None) -> None:
        mc, cc = config.model_config, config.cache_config
        self.model_identity, self.block_size = mc.model_identity, cc.block_size
        self.in_place = config.device == "cpu"  # the engine's blocks are host memory P can write into
        self.transfer_timeout_s = cc.transfer_timeout_s
        self.arena = arena
        if store is None:
            assert cc.kv_storage is not None  # check_pd_flags
            store = open_blob_store(cc.kv_storage, f"{mc.model_identity}|{mc.weight_version}", cc.storage_timeout_s,
                                    ttl_s=cc.kv_storage_ttl_s)
        self.store = store
        self.last: dict[str, float] = {}  # the last room's numbers (tools/bench_pd.py reads them from the log)

    def keys(self, prompt_token_ids: list[int], weight_version: str) -> list[str]:
        n = len(prompt_token_ids) // self.block_size
        root = root_hash(self.model_identity, weight_version)
        return [h.hex() for h in hash_block_chain(root, prompt_token_ids, self.block_size, n)]

    async def read(self, prompt_token_ids: list[int], weight_version: str) -> list[bytes]:
        """P: the leading full prompt blocks its store holds (a missing one ends the run: D computes from it)."""
        keys = self.keys(prompt_token_ids, weight_version)

        def get() -> list[bytes]:
            out = []
            for k in keys:
                try:
                    blob = self.store.get(k)
                except StorageError as e:
                    logger.warning("cannot read block %s for the transfer: %s", k, e)
                    break
                if blob is None:
                    break
                out.append(bytes(blob))
            return out

        return await asyncio.to_thread(get)

    async def receive(self, boot: Bootstrap, prompt_token_ids: list[int], weight_version: str,
                      deadline: float) -> int:
        """D: P's blocks of the room, verified, into this server's store; how many. A failed transfer
        stores none (or the leading good ones) and the engine computes the rest: never an error."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            assert self.arena is not None  # a server that pulls rooms has one (roles.start_pd_role)
            blobs = await pull_room(self.arena, boot.host, boot.port, boot.room, deadline - loop.time())
        except TeError as e:
            logger.warning("room %d: no blocks from the prefill server (%s); computing the prompt here", boot.room, e)
            return 0
        t1 = time.perf_counter()
        keys = self.keys(prompt_token_ids, weight_version)[:len(blobs)]

        def put() -> int:
            for i, (k, blob) in enumerate(zip(keys, blobs)):
                try:
                    self.store.put(k, blob)
                except StorageError as e:
                    logger.warning("room %d: block %d not stored (%s); computing the prompt from there",
                                   boot.room, i, e)
                    return i
            return len(keys)

        n = await asyncio.to_thread(put)
        self.last = {"room": boot.room, "blocks": n, "bytes": sum(len(b) for b in blobs[:n]),
                     "transfer_s": t1 - t0, "store_s": time.perf_counter() - t1}
        logger.info("room %d: %d blocks (%d bytes) over the transfer engine in %.4f s, stored in %.4f s", boot.room,
                    n, self.last["bytes"], self.last["transfer_s"], self.last["store_s"])
        return n

    async def remote(self, boot: Bootstrap, deadline: float) -> RemoteBlocks | None:
        """D, CPU engines: the room as the engine's remote source, P writing its blocks straight into the
        engine's (cache_manager/pd_receive.py); None when P holds none or cannot say (the engine then
        computes the prompt). Its transfer is bounded well inside the CTM's own timeout."""
        import httpx

        remaining = max(deadline - asyncio.get_running_loop().time(), 0.1)
        try:
            async with httpx.AsyncClient(timeout=remaining) as client:
                m = await fetch_manifest(client, boot.host, boot.port, boot.room)
        except (httpx.HTTPError, ValueError, TeError) as e:
            logger.warning("room %d: no blocks from the prefill server (%s); computing the prompt here", boot.room, e)
            return None
        if not m.block_digests or len(m.block_digests) != len(m.checksums):
            return None
        return RemoteBlocks(boot.host, boot.port, boot.room, m.blob_nbytes, tuple(m.block_digests),
                            timeout_s=min(remaining, self.transfer_timeout_s / 2))

    async def release(self, boot: Bootstrap) -> None:
        """D, once its engine admitted the request: P drops the room from its outbox. The engine took
        only the blocks its GPU pool lacked (maybe none), and an outbox full of rooms nobody will pull
        would push out the rooms others still need. Best effort: a room already taken is a no-op."""
        import httpx

        try:
            async with httpx.AsyncClient(timeout=5.0) as client:
                await client.delete(f"http://{boot.host}:{boot.port}/pd/rooms/{boot.room}/kv")
        except httpx.HTTPError as e:
            logger.info("room %d: the prefill server did not take back its room (%s); it expires there", boot.room, e)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
        self.store.close()
