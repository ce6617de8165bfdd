"""PD's mooncake transfer into D's engine blocks, P's side: the bootstrap route where D's cache transfer
manager asks for a room's blocks, and the writes of each blob's pieces (the KV slice of every rank,
layer and K|V, then the routing rows) straight to their addresses in D's engine, over the transfer engine
P's API process already runs (te_transfer.py). D checks what landed and stamps its own routing tags
(cache_manager/pd_receive.py); P only moves bytes, and never more than the blob they are cut from.
"""

from __future__ import annotations

import asyncio

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from fastdeploy_r3.cache_manager.pd_receive import KvTarget, KvWritten
from fastdeploy_r3.entrypoints.pd.te_transfer import TeArena, TeSender, take_room


async def write_pieces(arena: TeArena, blobs: list[bytes], target: KvTarget) -> KvWritten:
    """P: blobs first, first + 1, ... of the room, each piece (offset, bytes) of a blob to its address in
    D's engine (its KV slices and rows, in place), all in one transfer: written whole or not at all."""
    n = max(0, min(len(blobs) - target.first, len(target.blocks)))
    if n == 0:
        return KvWritten(target.room, 0)
    chosen = blobs[target.first:target.first + n]
    size = sum(len(b) for b in chosen)
    off = arena.alloc(size)
    if off is None:
        return KvWritten(target.room, 0, f"the prefill server's transfer arena has no {size} bytes free")
    try:
        starts, pos = [], off
        for b in chosen:
            arena.buf[pos:pos + len(b)] = np.frombuffer(b, dtype=np.uint8)
            starts.append(pos)
            pos += len(b)

        def send() -> KvWritten:
            srcs, dsts, lens = [], [], []
            for i, (start, pieces) in enumerate(zip(starts, target.blocks, strict=False)):
                if any(o < 0 or o + k > len(chosen[i]) for o, k, _ in pieces):
                    return KvWritten(target.room, 0, f"block {target.first + i}: a piece lies outside its blob")
                srcs += [arena.base + start + o for o, _, _ in pieces]
                dsts += [a for _, _, a in pieces]
                lens += [k for _, k, _ in pieces]
            # one batch, one round trip; a batch that fails does not say which piece did: none counts
            rc = arena.engine.batch_transfer_sync_write(target.segment, srcs, dsts, lens)
            if rc != 0:
                return KvWritten(target.room, 0, f"transfer to {target.segment} failed (code {rc})")
            return KvWritten(target.room, n)

        return await asyncio.to_thread(send)
    finally:
        arena.free(off)


def add_in_place_route(app: FastAPI, te: TeSender) -> None:
    @app.post("/pd/rooms/{room}/kv")
    async def in_place(room: int, request: Request) -> JSONResponse:
        """The room's blocks written piece by piece into the blocks D's engine reserved."""
        got = await take_room(room, request, te.outbox, KvTarget.from_json)
        if isinstance(got, JSONResponse):
            return got
        target, blobs = got
        return JSONResponse((await write_pieces(te.arena, blobs, target)).to_json())

    @app.delete("/pd/rooms/{room}/kv")
    async def release(room: int) -> JSONResponse:
        """D admitted the request without needing (all of) the room: its blocks leave the outbox now."""
        return JSONResponse({"room": room, "dropped": te.outbox.take(room) is not None})
