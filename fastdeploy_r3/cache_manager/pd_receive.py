"""PD's mooncake transfer on the decode side, in the CTM: the prefill server (P) writes a room's blocks
straight into the GPU blocks this engine reserved for them (docs/pd.md).

    engine  StorageTier.lookup: the room's prompt blocks are found; start_load -> PD2GPU task
    CTM     PdReceiver.receive: POST P:bootstrap/pd/rooms/R/kv  KvTarget (this CTM's transfer engine
            segment; per block, (offset in the blob, bytes, address here) of every piece: the KV slice
            of each rank, layer and K|V, then the routing rows)
    P       writes each blob's pieces to their addresses over Mooncake Transfer Engine, answers KvWritten
    CTM     recomputes each block's blob checksum over this layout's header and what landed; the good
            leading blocks get the engine's fresh routing tags; acks as a storage load does

Only this process's transfer engine can land P's writes. When the end of a transfer is unknown (the
request timed out, or the connection was cut after it went out), a write could still land in blocks
the engine has since given to another request, KV and R3 rows alike: PeerWriteUnknown then ends the
CTM (cache_transfer_manager.py lets it through), the engine's supervisor fails every load in flight
(the requests compute those blocks) and starts a new CTM. A clean refusal (P unreachable before the
request, a room P does not hold, a failed write P reports) is an ordinary failed load.

Two ways for the bytes to land:
- direct (CPU engines): the workers' KV caches and the routing rows are host memory, registered with the
  transfer engine once; P writes every piece (each rank's K and V slice of each layer, then the rows) to
  its address in the engine's blocks, and D hashes the blocks where they landed.
- landing (CUDA engines): the blocks are device memory, which this transfer engine (TCP) cannot address.
  D registers a host buffer of the room's size for this transfer only; P writes each blob's body (KV of
  every rank, then the rows) into it; D hashes each body, copies the good leading blocks' KV into the
  device blocks (KVTiers.host_to_blocks, one H2D copy per rank) and their rows into the routing rows,
  then unregisters the buffer: a block that failed its check never reaches the engine's memory. This is
  the hop Mooncake's own TCP transport makes for device memory; GPUDirect RDMA into the KV cache is not
  built.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import xxhash

from fastdeploy_r3.blobstore.base import CHECKSUM_NBYTES
from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer
from fastdeploy_r3.cache_manager.storage import HEADER_NBYTES, BlockLayout
from fastdeploy_r3.cache_manager.transfer import RemoteBlocks

logger = logging.getLogger(__name__)

LAND_CHUNK_BYTES = 64 << 20  # landing: KV bytes copied into the device blocks at a time


class PeerWriteUnknown(Exception):  # noqa: N818 - a state, not an error the CTM may absorb
    """A prefill server may still write into this engine's blocks: the CTM must exit before any ack."""


@dataclass(frozen=True)
class KvTarget:
    """D -> P: write blocks first, first + 1, ... of the room; blocks[i] lists (offset in the blob,
    bytes, address in D's segment) of each of block i's pieces."""

    room: int
    segment: str
    first: int
    blocks: list[list[list[int]]]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> KvTarget:
        try:
            blocks = [[[int(x) for x in piece] for piece in b] for b in raw["blocks"]]
            if any(len(piece) != 3 for b in blocks for piece in b):
                raise ValueError("a piece is [offset, nbytes, address]")
            return cls(room=int(raw["room"]), segment=str(raw["segment"]), first=int(raw["first"]), blocks=blocks)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed block target ({e})") from None


@dataclass(frozen=True)
class KvWritten:
    """P -> D, a transfer's completion: the leading blocks written (into D's engine blocks, or as blobs into
    its API server's arena: entrypoints/pd/te_transfer.py), and why the rest were not."""

    room: int
    num_written: int
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> KvWritten:
        try:
            err = raw["error"]
            return cls(room=int(raw["room"]), num_written=int(raw["num_written"]),
                       error=None if err is None else str(err))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"the prefill server sent a malformed completion ({e})") from None


HostToBlocks = Callable[[list[int], list[list[np.ndarray]]], None]  # KVTiers.host_to_blocks


class PdReceiver:
    """One transfer engine of the CTM's. Direct (gpu_kv: the workers' host-memory KV caches, registered
    with the routing rows once) or landing (host_to_blocks: how KV bytes reach device blocks; a host
    buffer registered per transfer)."""

    def __init__(self, routing: RoutingBuffer | None, layout: BlockLayout, block_size: int, host: str = "127.0.0.1",
                 *, gpu_kv: list[np.ndarray] | None = None,
                 host_to_blocks: HostToBlocks | None = None) -> None:  # fmt: skip
        from mooncake.engine import TransferEngine

        if (gpu_kv is None) == (host_to_blocks is None):
            raise ValueError("PdReceiver: pass gpu_kv (host-memory blocks P writes into) or host_to_blocks (a "
                             "landing buffer, then a copy into device blocks), exactly one")
        self.gpu_kv, self.host_to_blocks = gpu_kv or [], host_to_blocks
        self.routing, self.layout, self.block_size = routing, layout, block_size
        self.body_nbytes = layout.blob_nbytes - HEADER_NBYTES - CHECKSUM_NBYTES  # KV of every rank, then rows
        self._kept: list[np.ndarray] = []  # landing buffers a late write may still reach: never freed
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"Mooncake Transfer Engine did not start on {host} (tcp, P2P handshake)")
        self._regions: list[np.ndarray] = []
        self._lock = threading.Lock()  # the CTM receives up to four rooms at once, on threads (ctm_process.py)
        for a in (self.gpu_kv + ([routing.rows] if routing is not None else [])) if gpu_kv is not None else []:
            self._register(a)
        self.segment = f"{host}:{self.engine.get_rpc_port()}"

    def _register(self, a: np.ndarray) -> None:
        if self.engine.register_memory(int(a.ctypes.data), a.nbytes) != 0:
            raise RuntimeError(f"Mooncake Transfer Engine refused to register {a.nbytes} bytes")
        with self._lock:
            self._regions.append(a)

    def _unregister(self, a: np.ndarray) -> None:
        self.engine.unregister_memory(int(a.ctypes.data))
        with self._lock:
            self._regions = [r for r in self._regions if r is not a]

    def _pieces(self, block_id: int) -> list[tuple[int, np.ndarray]]:
        """(offset in the blob, the block's memory here) per piece, in blob order."""
        out, off = [], HEADER_NBYTES
        for kv in self.gpu_kv:  # [num_layers, 2, num_blocks, block_bytes] bytes, one per rank
            for layer in range(kv.shape[0]):
                for k_or_v in range(2):
                    out.append((off, kv[layer, k_or_v, block_id]))
                    off += kv.shape[3]
        if self.routing is not None:
            out.append((off, self.routing.rows[block_id * self.block_size:(block_id + 1) * self.block_size]))
        return out

    def digest(self, block_id: int) -> int:
        """The xxh3_64 a stored blob of this block's bytes as they are now would end with."""
        return self._hash([mem for _, mem in self._pieces(block_id)])

    def _hash(self, parts: list[np.ndarray]) -> int:
        """The xxh3_64 of a blob of this layout whose body is `parts` (its trailer)."""
        h = xxhash.xxh3_64(self.layout.header())
        for mem in parts:
            h.update(np.ascontiguousarray(mem).data)
        return h.intdigest()

    def receive(self, gpu_ids: list[int], tags: list[int], remote: RemoteBlocks,
                first: int) -> tuple[int, list[int], str | None]:  # fmt: skip
        """(bytes landed, indices of the blocks not in place, why); raises PeerWriteUnknown."""
        n, t0 = len(gpu_ids), time.perf_counter()
        if remote.blob_nbytes != self.layout.blob_nbytes:
            return 0, list(range(n)), (f"the prefill server's blocks are {remote.blob_nbytes} bytes, this engine's "
                                       f"{self.layout.blob_nbytes}: another model, dtype, block size or TP size")
        n_remote = max(0, min(n, len(remote.block_digests) - first))
        if self.host_to_blocks is None:
            blocks = [[[off, mem.nbytes, int(mem.ctypes.data)] for off, mem in self._pieces(g)]
                      for g in gpu_ids[:n_remote]]  # fmt: skip
            written, error = self._request(remote, first, blocks)
            good = self._good_leading(written, [self.digest(g) for g in gpu_ids[:written]], remote, first)
        else:
            land = np.empty((max(n_remote, 1), self.body_nbytes), np.uint8)
            try:
                self._register(land)
            except RuntimeError as e:
                return 0, list(range(n)), f"room {remote.room}: no landing buffer ({e})"
            try:
                base = int(land.ctypes.data)
                blocks = [[[HEADER_NBYTES, self.body_nbytes, base + i * self.body_nbytes]] for i in range(n_remote)]
                written, error = self._request(remote, first, blocks)
            except PeerWriteUnknown:
                with self._lock:
                    self._kept.append(land)  # registered and alive for good: a late write lands only here
                raise
            self._unregister(land)
            digests = [self._hash([land[i]]) for i in range(written)]
            good = self._good_leading(written, digests, remote, first)
            self._land(gpu_ids[:good], land[:good])
        if self.routing is not None:
            for g, tag in zip(gpu_ids[:good], tags[:good], strict=True):
                self.routing.tags[g * self.block_size:(g + 1) * self.block_size] = tag
        if good < n and error is None:
            error = f"room {remote.room}: {good} of {n} blocks in place"
        landed = good * (self.layout.num_ranks * self.layout.kv_nbytes + self.layout.rows_nbytes)
        if good < n:
            logger.warning("room %d: %d of %d blocks in place (%d asked of the prefill server, %d written): %s",
                           remote.room, good, n, n_remote, written, error)
        if written:
            logger.info("room %d: %d blocks (%d bytes) over the transfer engine in %.4f s, in place", remote.room, good,
                        landed, time.perf_counter() - t0)  # tools/bench_pd.py reads this line
        return landed, list(range(good, n)), error if good < n else None

    def _request(self, remote: RemoteBlocks, first: int, blocks: list[list[list[int]]]) -> tuple[int, str | None]:
        """Ask P to write the room's blocks first, first + 1, ... as `blocks` says: (blocks P wrote, why not
        all); a clean refusal writes none. Raises PeerWriteUnknown when the transfer's end is unknown."""
        import httpx

        from fastdeploy_r3.http_clients import sync_client

        target = KvTarget(remote.room, self.segment, first, blocks)
        url = f"http://{remote.host}:{remote.port}/pd/rooms/{remote.room}/kv"
        try:
            with sync_client(remote.timeout_s) as client:
                r = client.post(url, json=target.to_json())
        except httpx.ConnectError as e:  # refused before anything was sent: nothing can land
            return 0, f"room {remote.room}: the prefill server's bootstrap is unreachable ({e})"
        except httpx.HTTPError as e:
            why = f"{type(e).__name__}: {e}"
            raise PeerWriteUnknown(f"room {remote.room}: the transfer's end is unknown ({why})") from e
        if r.status_code != 200:
            return 0, f"room {remote.room}: the prefill server answered {r.status_code}: {r.text[:200]}"
        try:
            written = KvWritten.from_json(r.json())
        except ValueError as e:
            raise PeerWriteUnknown(f"room {remote.room}: {e}") from None
        return max(0, min(written.num_written, len(blocks))), written.error

    @staticmethod
    def _good_leading(written: int, digests: list[int], remote: RemoteBlocks, first: int) -> int:
        """How many of the written blocks, from the first, hash to what P stored."""
        for i in range(written):
            if digests[i] != remote.block_digests[first + i]:
                logger.warning("room %d: block %d arrived with other bytes than P stored; computing the prompt from "
                               "there", remote.room, first + i)
                return i
        return written

    def _land(self, gpu_ids: list[int], bodies: np.ndarray) -> None:
        """Landing: the checked bodies' KV into the device blocks, their rows into the routing rows."""
        if not gpu_ids:
            return
        kv_nbytes, ranks = self.layout.kv_nbytes, self.layout.num_ranks
        assert self.host_to_blocks is not None
        # a few blocks a copy: host_to_blocks stages what it copies on the device, and a long prompt's room
        # is GBs (32k tokens of Qwen3-30B-A3B: 3 GB) beside a KV cache that fills the rest of the memory
        step = max(1, LAND_CHUNK_BYTES // (ranks * kv_nbytes))
        for i in range(0, len(gpu_ids), step):
            self.host_to_blocks(gpu_ids[i:i + step], [[body[r * kv_nbytes:(r + 1) * kv_nbytes] for r in range(ranks)]
                                                      for body in bodies[i:i + step]])  # fmt: skip
        if self.routing is not None:
            rows = self.routing.rows
            for g, body in zip(gpu_ids, bodies, strict=True):
                src = body[ranks * kv_nbytes:ranks * kv_nbytes + self.layout.rows_nbytes]
                rows[g * self.block_size:(g + 1) * self.block_size] = src.view(rows.dtype).reshape(
                    self.block_size, *rows.shape[1:])

    def close(self) -> None:
        for a in list(self._regions):
            self._unregister(a)
