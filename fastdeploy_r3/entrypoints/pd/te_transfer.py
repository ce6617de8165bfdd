"""The Mooncake Transfer Engine backend of PD (`--disaggregation-transfer-backend mooncake`).

P writes a room's block blobs (KV of every rank with the block's R3 rows, one checksummed blob per full
prompt block, cache_manager/storage.py) straight into memory D reserved for them, over Mooncake
Transfer Engine (TCP on loopback here, RDMA where the machine has it), instead of through a store the
two servers share. Each server registers one arena with its engine at start: D's receives, P's holds
the bytes it is writing (the writer registers its source, the target its destination).

    P  computes the prompt, waits for its write-through, reads the prompt's blobs from its own store
       into its Outbox, publishes the room's handoff
    D  GET  P:bootstrap/pd/rooms/R/manifest   -> Manifest (blob size, one xxh3_64 per blob)
       reserves len(checksums) blobs in its arena
       POST P:bootstrap/pd/rooms/R/te TeTarget -> P writes them over TE -> KvWritten (the completion)
       checks every blob against the manifest's checksum (and the blob's own), stores the leading good
       ones in its own store, frees the reservation: the request's full prompt blocks are storage hits

A blob that fails its checksum, or every blob after a failed write, is not stored: D computes the
prompt from that block on (R3 stays exact). The reservation is freed whatever happens.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import xxhash
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from fastdeploy_r3.blobstore.base import CHECKSUM_NBYTES
from fastdeploy_r3.cache_manager.pd_receive import KvWritten

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)

DEFAULT_ARENA_MB = 64
OUTBOX_TTL_S = 120.0  # a room D never pulled is dropped after this long


class TeError(RuntimeError):
    """The transfer engine could not start or move a room's blobs; D then computes the prompt itself."""


def blob_checksum(blob: bytes | memoryview | np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(blob).cast("B") if not isinstance(blob, np.ndarray) else blob.data)


@dataclass(frozen=True)
class Manifest:
    """P -> D: what P holds for a room (every blob of one layout has the same size)."""

    room: int
    blob_nbytes: int
    checksums: list[str] = field(default_factory=list)
    # per blob, the xxh3_64 it ends with (over its header, KV and rows): what a block written in place at D
    # must hash to (cache_manager/pd_receive.py)
    block_digests: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> Manifest:
        try:
            m = cls(room=int(raw["room"]), blob_nbytes=int(raw["blob_nbytes"]),
                    checksums=[str(c) for c in raw["checksums"]],
                    block_digests=[int(d) for d in raw.get("block_digests", [])])
        except (KeyError, TypeError, ValueError) as e:
            raise TeError(f"the prefill server sent a malformed manifest ({e})") from None
        if m.blob_nbytes < 0 or (m.checksums and m.blob_nbytes == 0):
            raise TeError(f"the prefill server sent a manifest with blob_nbytes {m.blob_nbytes}")
        return m


@dataclass(frozen=True)
class TeTarget:
    """D -> P: where to write a room's blobs: D's engine segment and one address per blob."""

    room: int
    segment: str  # host:rpc_port of D's transfer engine
    addresses: list[int]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> TeTarget:
        try:
            return cls(room=int(raw["room"]), segment=str(raw["segment"]),
                       addresses=[int(a) for a in raw["addresses"]])
        except (KeyError, TypeError, ValueError) as e:
            raise TeError(f"malformed transfer target ({e})") from None


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

    def write(self, segment: str, off: int, remote_address: int, nbytes: int) -> None:
        """Blocking: nbytes from this arena at off into the peer's registered memory (a thread's call)."""
        rc = self.engine.transfer_sync_write(segment, self.base + off, remote_address, nbytes)
        if rc != 0:
            raise TeError(f"transfer to {segment} failed (code {rc})")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine.unregister_memory(self.base)


class Outbox:
    """P: the blobs of each published room, until D has pulled them (or OUTBOX_TTL_S passed)."""

    def __init__(self, ttl_s: float = OUTBOX_TTL_S, max_bytes: int = 1 << 30) -> None:
        self.ttl_s, self.max_bytes = ttl_s, max_bytes
        self._rooms: OrderedDict[int, tuple[float, list[bytes]]] = OrderedDict()

    def put(self, room: int, blobs: list[bytes]) -> None:
        now = time.monotonic()
        self._rooms[room] = (now, blobs)
        self._rooms.move_to_end(room)
        while self._rooms and (self.nbytes() > self.max_bytes
                               or next(iter(self._rooms.values()))[0] < now - self.ttl_s):
            self._rooms.popitem(last=False)

    def manifest(self, room: int) -> Manifest | None:
        entry = self._rooms.get(room)
        if entry is None:
            return None
        blobs = entry[1]
        return Manifest(room, len(blobs[0]) if blobs else 0, [blob_checksum(b) for b in blobs],
                        [int.from_bytes(b[-CHECKSUM_NBYTES:], "little") for b in blobs])

    def take(self, room: int) -> list[bytes] | None:
        entry = self._rooms.pop(room, None)
        return None if entry is None else entry[1]

    def nbytes(self) -> int:
        return sum(len(b) for _, blobs in self._rooms.values() for b in blobs)

    def __len__(self) -> int:
        return len(self._rooms)


async def write_room(arena: TeArena, blobs: list[bytes], target: TeTarget) -> KvWritten:
    """P: the room's blobs into D's addresses, in order; stops at the first that fails."""
    n = min(len(blobs), len(target.addresses))
    if n == 0:
        return KvWritten(target.room, 0)
    size = sum(len(b) for b in blobs[:n])
    off = arena.alloc(size)
    if off is None:
        return KvWritten(target.room, 0, f"the prefill server's transfer arena has no {size} bytes free")
    try:
        pos = off
        for b in blobs[:n]:
            arena.buf[pos:pos + len(b)] = np.frombuffer(b, dtype=np.uint8)
            pos += len(b)

        def send() -> KvWritten:
            # one write per run of blobs contiguous at D (D reserves a room's blobs in one range: one
            # write), each a round trip; a failed run ends the room there
            at, i = off, 0
            while i < n:
                j, nbytes = i + 1, len(blobs[i])
                while j < n and target.addresses[j] == target.addresses[i] + nbytes:
                    nbytes += len(blobs[j])
                    j += 1
                try:
                    arena.write(target.segment, at, target.addresses[i], nbytes)
                except TeError as e:
                    return KvWritten(target.room, i, str(e))
                at, i = at + nbytes, j
            return KvWritten(target.room, n)

        return await asyncio.to_thread(send)
    finally:
        arena.free(off)


def verified_blobs(arena: TeArena, off: int, manifest: Manifest, num_written: int) -> list[bytes]:
    """D: copies of the leading written blobs whose checksum matches the manifest's (the first that does
    not ends the run: the request computes from that block on)."""
    out = []
    for i in range(min(num_written, len(manifest.checksums))):
        view = arena.buf[off + i * manifest.blob_nbytes: off + (i + 1) * manifest.blob_nbytes]
        if blob_checksum(view) != manifest.checksums[i]:
            logger.warning("room %d: block %d arrived with another checksum than P sent; computing the prompt from "
                           "there", manifest.room, i)
            break
        out.append(view.tobytes())
    return out


async def fetch_manifest(client: httpx.AsyncClient, host: str, port: int, room: int) -> Manifest:
    """D: P's manifest of `room`. TeError when P answers anything but 200 (no such room, or not yet),
    ValueError when the answer is malformed, httpx's errors when P cannot be reached."""
    r = await client.get(f"http://{host}:{port}/pd/rooms/{room}/manifest")
    if r.status_code != 200:
        raise TeError(f"the prefill server answered {r.status_code} for room {room}'s manifest: {r.text[:200]}")
    return Manifest.from_json(r.json())


async def pull_room(arena: TeArena, host: str, port: int, room: int, timeout_s: float) -> list[bytes]:
    """D: the room's verified blobs, written by P into this arena over TE; the reservation is always
    freed. TeError when P cannot be asked or the arena is full (D then computes the prompt itself)."""
    import httpx

    timeout_s = max(timeout_s, 0.1)
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            manifest = await fetch_manifest(client, host, port, room)
            if not manifest.checksums:
                return []
            off = arena.alloc(manifest.blob_nbytes * len(manifest.checksums))
            if off is None:
                raise TeError(f"the decode server's transfer arena has no room for {len(manifest.checksums)} blocks "
                              f"of {manifest.blob_nbytes} bytes; raise --disaggregation-te-arena-mb")
            try:
                target = TeTarget(room, arena.segment, [arena.base + off + i * manifest.blob_nbytes
                                                        for i in range(len(manifest.checksums))])
                r = await client.post(f"http://{host}:{port}/pd/rooms/{room}/te", json=target.to_json())
                if r.status_code != 200:
                    raise TeError(f"the prefill server answered {r.status_code} for room {room}'s transfer: "
                                  f"{r.text[:200]}")
                written = KvWritten.from_json(r.json())
                if written.error is not None:
                    logger.warning("room %d: the prefill server wrote %d of %d blocks: %s", room, written.num_written,
                                   len(manifest.checksums), written.error)
                return verified_blobs(arena, off, manifest, written.num_written)
            finally:
                arena.free(off)
    except (httpx.HTTPError, ValueError) as e:
        raise TeError(f"room {room}: the prefill server's bootstrap {host}:{port} failed the transfer "
                      f"({type(e).__name__}: {e})") from None


@dataclass
class TeSender:
    """P's side: its arena and the blobs of the rooms it published."""

    arena: TeArena
    outbox: Outbox


class _RoomTarget(Protocol):
    @property
    def room(self) -> int: ...


T = TypeVar("T", bound=_RoomTarget)


async def take_room(room: int, request: Request, outbox: Outbox, parse: Callable[[Any], T]
                    ) -> tuple[T, list[bytes]] | JSONResponse:  # fmt: skip
    """P, a transfer route (/te, /kv: te_in_place.py): D's target for `room`, parsed and checked against the
    path, and the room's blobs taken from the outbox; or the answer that says why not (400, 404)."""
    try:
        target = parse(await request.json())
    except (TeError, ValueError) as e:
        return JSONResponse({"error": str(e)}, status_code=400)
    if target.room != room:
        return JSONResponse({"error": f"target names room {target.room}, the path {room}"}, status_code=400)
    blobs = outbox.take(room)
    if blobs is None:
        return JSONResponse({"error": f"room {room} has no blocks here"}, status_code=404)
    return target, blobs


def add_te_routes(app: FastAPI, te: TeSender) -> None:
    """P's bootstrap server: a room's manifest, and the transfer into D's reserved memory."""
    @app.get("/pd/rooms/{room}/manifest")
    async def manifest(room: int) -> JSONResponse:
        m = te.outbox.manifest(room)
        if m is None:
            return JSONResponse({"error": f"room {room} has no blocks here (not published, already pulled, or "
                                          "expired)"}, status_code=404)
        return JSONResponse(m.to_json())

    @app.post("/pd/rooms/{room}/te")
    async def transfer(room: int, request: Request) -> JSONResponse:
        got = await take_room(room, request, te.outbox, TeTarget.from_json)
        if isinstance(got, JSONResponse):
            return got
        target, blobs = got
        return JSONResponse((await write_room(te.arena, blobs, target)).to_json())
