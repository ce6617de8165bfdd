"""The Mooncake Transfer Engine backend of PD (`--disaggregation-transfer-backend mooncake`), P's side
and the messages: P writes a room's blocks (KV of every rank with the block's R3 rows, one checksummed
blob per prompt block, the partial last one too, cache_manager/storage.py) into memory D's cache
transfer manager registered for them, over Mooncake Transfer Engine (TCP on loopback here), instead of
through a store the two servers share. P's API process registers one arena, the bytes it is writing
(a writer registers its source, the target its destination).

    P  computes the prompt, waits for its write-through, names the prompt's blobs in its own store in
       its Outbox (their sizes and trailers: read again for the transfer), publishes the room's handoff
    D  GET  P:bootstrap/pd/rooms/R/manifest   -> Manifest (blob size, one xxh3_64 per blob)
       its engine admits the request with the room; its CTM asks P for the blocks:
       POST P:bootstrap/pd/rooms/R/kv KvTarget -> P writes them over TE -> KvWritten (the completion)
       (te_in_place.py, cache_manager/pd_receive.py)
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from fastdeploy_r3.blobstore.base import stored_checksum
from fastdeploy_r3.cache_manager.pd_receive import KvTarget

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)

DEFAULT_ARENA_MB = 64
OUTBOX_TTL_S = 120.0  # a room D never pulled is dropped after this long


class TeError(RuntimeError):
    """The transfer engine could not start or move a room's blobs; D then computes the prompt itself."""


@dataclass(frozen=True)
class Manifest:
    """P -> D: what P holds for a room (every blob of one layout has the same size)."""

    room: int
    blob_nbytes: int
    # per blob, the xxh3_64 it ends with (over its header, KV and rows): what a block written at D must hash
    # to (cache_manager/pd_receive.py)
    block_digests: list[int] = field(default_factory=list)
    tail_tokens: int = 0  # > 0: the last blob is the prompt's partial last block, with this many tokens

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> Manifest:
        try:
            m = cls(room=int(raw["room"]), blob_nbytes=int(raw["blob_nbytes"]),
                    block_digests=[int(d) for d in raw["block_digests"]], tail_tokens=int(raw["tail_tokens"]))
        except (KeyError, TypeError, ValueError) as e:
            raise TeError(f"the prefill server sent a malformed manifest ({e})") from None
        if m.blob_nbytes < 0 or (m.block_digests and m.blob_nbytes == 0):
            raise TeError(f"the prefill server sent a manifest with blob_nbytes {m.blob_nbytes}")
        if m.tail_tokens < 0 or (m.tail_tokens and not m.block_digests):
            raise TeError(f"the prefill server sent a manifest with tail_tokens {m.tail_tokens} and "
                          f"{len(m.block_digests)} blocks")
        return m


class Extents:
    """First-fit allocation of byte ranges in an arena; freed neighbours merge."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes > 0 else []  # (offset, size), by offset
        self._used: dict[int, int] = {}

    def alloc(self, size: int) -> int | None:
        if size <= 0:
            raise ValueError(f"alloc({size})")
        for i, (off, n) in enumerate(self._free):
            if n >= size:
                self._free[i:i + 1] = [(off + size, n - size)] if n > size else []
                self._used[off] = size
                return off
        return None

    def free(self, off: int) -> None:
        size = self._used.pop(off)
        i = bisect.bisect(self._free, (off, size))
        self._free.insert(i, (off, size))
        if i + 1 < len(self._free) and off + size == self._free[i + 1][0]:
            self._free[i:i + 2] = [(off, size + self._free[i + 1][1])]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            self._free[i - 1:i + 1] = [(self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])]

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())


class TeArena:
    """One transfer engine and one registered buffer (registered once, at start)."""

    def __init__(self, nbytes: int, host: str = "127.0.0.1") -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise TeError("--disaggregation-transfer-backend mooncake needs the mooncake-transfer-engine "
                          "package") from e
        self.buf = np.zeros(nbytes, dtype=np.uint8)
        self.extents = Extents(nbytes)
        self._lock = threading.Lock()  # the extents: allocated on the loop, freed from transfer threads
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise TeError(f"Mooncake Transfer Engine did not start on {host} (tcp, P2P handshake)")
        self.base = int(self.buf.ctypes.data)
        if self.engine.register_memory(self.base, nbytes) != 0:
            raise TeError(f"Mooncake Transfer Engine refused to register {nbytes} bytes")
        self.segment = f"{host}:{self.engine.get_rpc_port()}"
        self.closed = False

    def alloc(self, size: int) -> int | None:
        with self._lock:
            return self.extents.alloc(size)

    def free(self, off: int) -> None:
        with self._lock:
            self.extents.free(off)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self.extents.used_bytes

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine.unregister_memory(self.base)


@dataclass(frozen=True)
class OutboxBlob:
    """One block of a published room as P holds it: its size and trailer (what D checks what lands
    against) and how to read it again. P keeps the blobs in its store, not in memory: a room of a long
    prompt is GBs (32k tokens of Qwen3-30B-A3B: 3 GB), and rooms waiting for their D would push each
    other out of any memory cap."""

    nbytes: int
    digest: int
    read: Callable[[], bytes | None]  # None: no longer where it was kept (evicted, expired)

    @classmethod
    def of(cls, blob: bytes) -> OutboxBlob:
        """A blob held in memory."""
        return cls(len(blob), stored_checksum(blob), lambda: blob)


class Outbox:
    """P: the blocks of each published room, until D has taken them (or OUTBOX_TTL_S passed)."""

    def __init__(self, ttl_s: float = OUTBOX_TTL_S, max_rooms: int = 4096) -> None:
        self.ttl_s, self.max_rooms = ttl_s, max_rooms
        self._rooms: OrderedDict[int, tuple[float, list[OutboxBlob], int]] = OrderedDict()

    def put(self, room: int, blobs: list[OutboxBlob], tail_tokens: int = 0) -> None:
        """tail_tokens > 0: the last blob is the prompt's partial last block, holding that many tokens."""
        now = time.monotonic()
        self._rooms[room] = (now, blobs, tail_tokens)
        self._rooms.move_to_end(room)
        while self._rooms and (len(self._rooms) > self.max_rooms
                               or next(iter(self._rooms.values()))[0] < now - self.ttl_s):
            self._rooms.popitem(last=False)

    def manifest(self, room: int) -> Manifest | None:
        entry = self._rooms.get(room)
        if entry is None:
            return None
        _, blobs, tail_tokens = entry
        return Manifest(room, blobs[0].nbytes if blobs else 0, [b.digest for b in blobs], tail_tokens)

    def take(self, room: int) -> list[OutboxBlob] | None:
        entry = self._rooms.pop(room, None)
        return None if entry is None else entry[1]

    def __len__(self) -> int:
        return len(self._rooms)


async def fetch_manifest(client: httpx.AsyncClient, host: str, port: int, room: int) -> Manifest:
    """D: P's manifest of `room`. TeError when P answers anything but 200 (no such room, or not yet),
    ValueError when the answer is malformed, httpx's errors when P cannot be reached."""
    r = await client.get(f"http://{host}:{port}/pd/rooms/{room}/manifest")
    if r.status_code != 200:
        raise TeError(f"the prefill server answered {r.status_code} for room {room}'s manifest: {r.text[:200]}")
    return Manifest.from_json(r.json())


@dataclass
class TeSender:
    """P's side: its arena and the blobs of the rooms it published."""

    arena: TeArena
    outbox: Outbox


async def take_room(room: int, request: Request, outbox: Outbox) -> tuple[KvTarget, list[OutboxBlob]] | JSONResponse:
    """P, the transfer route (/kv: te_in_place.py): D's target for `room`, parsed and checked against the
    path, and the room's blobs taken from the outbox; or the answer that says why not (400, 404)."""
    try:
        target = KvTarget.from_json(await request.json())
    except ValueError as e:
        return JSONResponse({"error": str(e)}, status_code=400)
    if target.room != room:
        return JSONResponse({"error": f"target names room {target.room}, the path {room}"}, status_code=400)
    blobs = outbox.take(room)
    if blobs is None:
        return JSONResponse({"error": f"room {room} has no blocks here"}, status_code=404)
    return target, blobs


def add_te_routes(app: FastAPI, te: TeSender) -> None:
    """P's bootstrap server: a room's manifest (the transfer's route is te_in_place.py's)."""
    @app.get("/pd/rooms/{room}/manifest")
    async def manifest(room: int) -> JSONResponse:
        m = te.outbox.manifest(room)
        if m is None:
            return JSONResponse({"error": f"room {room} has no blocks here (not published, already pulled, or "
                                          "expired)"}, status_code=404)
        return JSONResponse(m.to_json())
