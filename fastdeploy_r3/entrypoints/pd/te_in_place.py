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

from fastdeploy_r3.blobstore.base import stored_checksum
from fastdeploy_r3.cache_manager.pd_receive import KvTarget, KvWritten
from fastdeploy_r3.entrypoints.pd.te_transfer import OutboxBlob, TeArena, TeSender, take_room


async def write_pieces(arena: TeArena, blobs: list[OutboxBlob], target: KvTarget) -> KvWritten:
    """P: blobs first, first + 1, ... of the room, each piece (offset, bytes) of a blob to its address in D
    (its engine's KV slices and rows, or its landing buffer), in batches of whole blobs that fit P's arena
    (a quarter of it, at least one blob): one round trip each. A batch is written whole or not at all; one
    that fails, or a blob no longer in P's store as it was published, ends the room there (the blocks of
    the batches before it count)."""
    n = max(0, min(len(blobs) - target.first, len(target.blocks)))
    chosen = blobs[target.first:target.first + n]
    for i, pieces in enumerate(target.blocks[:n]):
        if any(o < 0 or o + k > chosen[i].nbytes for o, k, _ in pieces):
            return KvWritten(target.room, 0, f"block {target.first + i}: a piece lies outside its blob")
    done = 0
    while done < n:
        end, size = done + 1, chosen[done].nbytes
        while end < n and size + chosen[end].nbytes <= arena.extents.nbytes // 4:
            size += chosen[end].nbytes
            end += 1
        off = arena.alloc(size)
        if off is None and end > done + 1:  # other rooms hold the arena: one blob at a time
            end, size = done + 1, chosen[done].nbytes
            off = arena.alloc(size)
        if off is None:
            return KvWritten(target.room, done, f"the prefill server's transfer arena has no {size} bytes free; "
                                                "raise --disaggregation-te-arena-mb")
        try:
            copied, rc = await asyncio.to_thread(_send_batch, arena, off, chosen[done:end], target.blocks[done:end],
                                                 target.segment)  # fmt: skip
        finally:
            arena.free(off)
        if rc != 0:  # a batch that fails does not say which piece did: none of it counts
            return KvWritten(target.room, done, f"transfer to {target.segment} failed (code {rc})")
        if copied < end - done:
            return KvWritten(target.room, done + copied, f"block {target.first + done + copied} is no longer in the "
                                                         "prefill server's store as it was published")
        done = end
    return KvWritten(target.room, n)


def _send_batch(arena: TeArena, off: int, blobs: list[OutboxBlob], blocks: list[list[list[int]]],
                segment: str) -> tuple[int, int]:  # fmt: skip
    """The blobs read into the arena at off, then every piece of theirs written in one batch: (blobs read as
    published, the batch's code). A blob gone or changed ends the batch before it."""
    srcs, dsts, lens, pos, read = [], [], [], off, 0
    for blob, pieces in zip(blobs, blocks, strict=True):
        data = blob.read()
        if data is None or len(data) != blob.nbytes or stored_checksum(data) != blob.digest:
            break
        arena.buf[pos:pos + len(data)] = np.frombuffer(data, dtype=np.uint8)
        srcs += [arena.base + pos + o for o, _, _ in pieces]
        dsts += [a for _, _, a in pieces]
        lens += [k for _, k, _ in pieces]
        pos, read = pos + len(data), read + 1
    return read, arena.engine.batch_transfer_sync_write(segment, srcs, dsts, lens) if srcs else 0


def add_in_place_route(app: FastAPI, te: TeSender) -> None:
    @app.post("/pd/rooms/{room}/kv")
    async def in_place(room: int, request: Request) -> JSONResponse:
        """The room's blocks written piece by piece into the blocks D's engine reserved."""
        got = await take_room(room, request, te.outbox)
        if isinstance(got, JSONResponse):
            return got
        target, blobs = got
        return JSONResponse((await write_pieces(te.arena, blobs, target)).to_json())

    @app.delete("/pd/rooms/{room}/kv")
    async def release(room: int) -> JSONResponse:
        """D admitted the request without needing (all of) the room: its blocks leave the outbox now."""
        return JSONResponse({"room": room, "dropped": te.outbox.take(room) is not None})
