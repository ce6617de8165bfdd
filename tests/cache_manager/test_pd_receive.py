"""PD's transfer into D's engine blocks without servers: P's bootstrap server (its arena, an outbox of
stored block blobs) writes each blob's pieces, the KV slice of every rank, layer and K|V and the
routing rows, straight into D's "GPU" KV arrays and rows over two Mooncake Transfer Engines on
loopback (cache_manager/pd_receive.py, entrypoints/pd/te_in_place.py).

Tiny layout: 2 ranks, 2 layers, blocks of 2 tokens, 1 KV head of 2 float32 (16 bytes per layer and
K|V), rows [2 tokens, 2 layers, top-2] int32; D has 6 blocks. Each story asserts which of D's blocks
hold which blob, the tags stamped, and that nothing else was written. The stories run both ways a
receiver lands bytes: direct (P writes into the blocks, a CPU engine) and landing (P writes into a
buffer registered for the transfer, D copies the checked blocks in: how a CUDA engine receives, here
with a copy into host arrays standing in for KVTiers.host_to_blocks)."""

from __future__ import annotations

import asyncio
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

from fastdeploy_r3.cache_manager import pd_receive
from fastdeploy_r3.cache_manager.pd_receive import KvTarget, KvWritten, PdReceiver, PeerWriteUnknown
from fastdeploy_r3.cache_manager.storage import BlockLayout, encode_block
from fastdeploy_r3.cache_manager.transfer import RemoteBlocks
from fastdeploy_r3.entrypoints.pd.bootstrap import BootstrapServer, Rooms
from fastdeploy_r3.entrypoints.pd.te_in_place import write_pieces
from fastdeploy_r3.entrypoints.pd.te_transfer import Outbox, OutboxBlob, TeArena, TeSender

RANKS, LAYERS, BLOCK, HEADS, DIM = 2, 2, 2, 1, 2
SLICE = BLOCK * HEADS * DIM * 4  # bytes of one (layer, K|V) of a block
LAYOUT = BlockLayout(RANKS, (LAYERS, 2, BLOCK, HEADS, DIM), "float32", 4, (BLOCK, LAYERS, 2), "int32")
NUM_BLOCKS = 6


def _blob(seed: int) -> tuple[bytes, list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    kv = [rng.integers(0, 256, LAYERS * 2 * SLICE, dtype=np.uint8) for _ in range(RANKS)]
    rows = rng.integers(0, 64, (BLOCK, LAYERS, 2), dtype=np.int32)
    return encode_block(LAYOUT, kv, rows), kv, rows


def _digest(blob: bytes) -> int:
    return int.from_bytes(blob[-8:], "little")


class _D:
    """D's engine memory: zeroed KV per rank [layers, 2, blocks, slice bytes], rows and tags per slot."""

    def __init__(self, landing: bool = False) -> None:
        self.kv = [np.zeros((LAYERS, 2, NUM_BLOCKS, SLICE), np.uint8) for _ in range(RANKS)]
        self.routing = SimpleNamespace(rows=np.zeros((NUM_BLOCKS * BLOCK, LAYERS, 2), np.int32),
                                       tags=np.zeros(NUM_BLOCKS * BLOCK, np.int64))
        self.copied: list[list[int]] = []  # landing: the block ids of each copy into the blocks
        if landing:
            self.receiver = PdReceiver(self.routing, LAYOUT, BLOCK, host_to_blocks=self._host_to_blocks)
        else:
            self.receiver = PdReceiver(self.routing, LAYOUT, BLOCK, gpu_kv=self.kv)

    def _host_to_blocks(self, block_ids: list[int], parts: list[list[np.ndarray]]) -> None:
        self.copied.append(list(block_ids))
        for b, per_rank in zip(block_ids, parts, strict=True):
            for kv, part in zip(self.kv, per_rank, strict=True):
                kv[:, :, b] = part.reshape(LAYERS, 2, SLICE)

    def holds(self, block_id: int, kv: list[np.ndarray], rows: np.ndarray) -> bool:
        same_kv = all(np.array_equal(self.kv[r][:, :, block_id].reshape(-1), kv[r]) for r in range(RANKS))
        return same_kv and np.array_equal(self.routing.rows[block_id * BLOCK:(block_id + 1) * BLOCK], rows)

    def untouched(self, block_ids: list[int]) -> bool:
        return all(not self.kv[r][:, :, b].any() and not self.routing.rows[b * BLOCK:(b + 1) * BLOCK].any()
                   for r in range(RANKS) for b in block_ids)

    def tags(self) -> list[int]:
        return [int(t) for t in self.routing.tags[::BLOCK]]


@pytest.fixture(scope="module")
def p_arena() -> TeArena:
    arena = TeArena(1 << 16)
    yield arena
    arena.close()


def _with_p(p_arena: TeArena, rooms: dict[int, list[bytes]], body) -> None:
    """Run body(port) in a thread while P's bootstrap server (with these rooms in its outbox) serves."""
    async def run() -> None:
        outbox = Outbox()
        for room, blobs in rooms.items():
            outbox.put(room, [OutboxBlob.of(b) for b in blobs])
        server = BootstrapServer(Rooms(), "127.0.0.1", 0, TeSender(p_arena, outbox))
        try:
            await asyncio.to_thread(body, server.port)
        finally:
            await server.close()

    asyncio.run(run())


def test_targets_and_completions_survive_their_json() -> None:
    t = KvTarget(3, "127.0.0.1:9", 1, [[[96, 16, 4096]]])
    assert KvTarget.from_json(t.to_json()) == t and KvWritten.from_json(KvWritten(3, 1, "x").to_json()) == KvWritten(
        3, 1, "x")
    with pytest.raises(ValueError, match="a piece is"):
        KvTarget.from_json({"room": 3, "segment": "s", "first": 0, "blocks": [[[1, 2]]]})


@pytest.fixture(params=["direct", "landing"])
def landing(request) -> bool:
    return request.param == "landing"


def test_the_receiver_takes_one_way_to_land_bytes() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        PdReceiver(None, LAYOUT, BLOCK)


def test_p_writes_each_blob_into_the_blocks_d_reserved_and_d_stamps_its_tags(p_arena, landing) -> None:
    d = _D(landing)
    made = [_blob(s) for s in range(3)]
    blobs = [b for b, _, _ in made]
    room = RemoteBlocks("127.0.0.1", 0, 31, LAYOUT.blob_nbytes, tuple(_digest(b) for b in blobs))

    def body(port: int) -> None:
        here = RemoteBlocks(room.host, port, room.room, room.blob_nbytes, room.block_digests)
        nbytes, failed, error = d.receiver.receive([4, 1, 5], [101, 102, 103], here, 0)
        assert (failed, error, nbytes) == ([], None, 3 * (RANKS * LAYERS * 2 * SLICE + BLOCK * LAYERS * 2 * 4))

    _with_p(p_arena, {31: blobs}, body)
    assert [d.holds(g, kv, rows) for g, (_, kv, rows) in zip([4, 1, 5], made)] == [True, True, True]
    assert d.untouched([0, 2, 3]) and d.tags() == [0, 102, 0, 0, 101, 103]
    assert p_arena.used_bytes == 0
    assert d.copied == ([[4, 1, 5]] if landing else [])  # landing: one copy of the room's blocks
    assert len(d.receiver._regions) == (0 if landing else RANKS + 1)  # the landing buffer is unregistered


def test_landing_copies_a_room_into_the_device_blocks_a_few_blocks_at_a_time(p_arena, monkeypatch) -> None:
    """A long prompt's room is GBs: the copy into the device blocks goes two blocks at a time here."""
    monkeypatch.setattr(pd_receive, "LAND_CHUNK_BYTES", 2 * RANKS * LAYOUT.kv_nbytes)
    d = _D(landing=True)
    made = [_blob(s) for s in range(70, 75)]
    blobs = [b for b, _, _ in made]

    def body(port: int) -> None:
        room = RemoteBlocks("127.0.0.1", port, 43, LAYOUT.blob_nbytes, tuple(_digest(b) for b in blobs))
        assert d.receiver.receive([5, 4, 3, 2, 1], [1, 2, 3, 4, 5], room, 0)[1:] == ([], None)

    _with_p(p_arena, {43: blobs}, body)
    assert d.copied == [[5, 4], [3, 2], [1]] and all(d.holds(g, *m[1:]) for g, m in zip([5, 4, 3, 2, 1], made))


def test_a_room_larger_than_p_arena_goes_over_in_batches_and_one_blob_too_large_is_refused_by_flag(landing) -> None:
    """P's arena holds 4 blobs: a quarter of it is one blob, so the 5 blocks go over in 5 batches, all in
    place. An arena smaller than one blob writes nothing and names the flag to raise."""
    d = _D(landing)
    made = [_blob(s) for s in range(50, 55)]
    blobs = [b for b, _, _ in made]
    small, tiny = TeArena(4 * LAYOUT.blob_nbytes), TeArena(LAYOUT.blob_nbytes - 1)

    def body(port: int) -> None:
        room = RemoteBlocks("127.0.0.1", port, 37, LAYOUT.blob_nbytes, tuple(_digest(b) for b in blobs))
        assert d.receiver.receive([5, 4, 3, 2, 1], [1, 2, 3, 4, 5], room, 0)[1:] == ([], None)

    _with_p(small, {37: blobs}, body)
    assert all(d.holds(g, *m[1:]) for g, m in zip([5, 4, 3, 2, 1], made)) and small.used_bytes == 0

    def too_small(port: int) -> None:
        room = RemoteBlocks("127.0.0.1", port, 38, LAYOUT.blob_nbytes, tuple(_digest(b) for b in blobs))
        _, failed, error = d.receiver.receive([0], [9], room, 0)
        assert failed == [0] and "arena has no" in error and "--disaggregation-te-arena-mb" in error

    _with_p(tiny, {38: blobs}, too_small)
    assert d.untouched([0]) and d.tags()[0] == 0
    small.close()
    tiny.close()


def test_two_rooms_received_at_once_each_land_in_their_own_blocks(p_arena, landing) -> None:
    """The CTM receives rooms on threads: two at once, each into its own blocks, all buffers released."""
    d = _D(landing)
    made = [_blob(s) for s in range(60, 64)]
    rooms = {41: [b for b, _, _ in made[:2]], 42: [b for b, _, _ in made[2:]]}

    def body(port: int) -> None:
        def one(room: int, gpu_ids: list[int]) -> tuple:
            blobs = rooms[room]
            remote = RemoteBlocks("127.0.0.1", port, room, LAYOUT.blob_nbytes, tuple(_digest(b) for b in blobs))
            return d.receiver.receive(gpu_ids, [room, room], remote, 0)[1:]

        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(one, [41, 42], [[0, 1], [2, 3]]))
        assert got == [([], None), ([], None)]

    _with_p(p_arena, rooms, body)
    assert all(d.holds(g, *m[1:]) for g, m in zip([0, 1, 2, 3], made)) and d.tags() == [41, 41, 42, 42, 0, 0]
    assert len(d.receiver._regions) == (0 if landing else RANKS + 1)


def test_a_block_gone_from_p_store_since_it_was_published_ends_the_room_there(landing) -> None:
    """P names its blocks in its outbox and reads them again for the transfer: block 1 was evicted from
    its store in between, so blocks 0 lands and D computes from block 1 on."""
    d = _D(landing)
    made = [_blob(s) for s in range(80, 83)]
    blobs = [b for b, _, _ in made]
    held = [OutboxBlob.of(blobs[0]), OutboxBlob(len(blobs[1]), _digest(blobs[1]), lambda: None),
            OutboxBlob.of(blobs[2])]
    arena = TeArena(1 << 16)

    async def run() -> None:
        outbox = Outbox()
        outbox.put(44, held)
        server = BootstrapServer(Rooms(), "127.0.0.1", 0, TeSender(arena, outbox))
        try:
            room = RemoteBlocks("127.0.0.1", server.port, 44, LAYOUT.blob_nbytes, tuple(_digest(b) for b in blobs))
            _, failed, error = await asyncio.to_thread(d.receiver.receive, [3, 4, 5], [7, 8, 9], room, 0)
            assert failed == [1, 2] and "block 1 is no longer in the prefill server's store" in error
        finally:
            await server.close()

    asyncio.run(run())
    assert d.holds(3, *made[0][1:]) and d.untouched([4, 5]) and d.tags() == [0, 0, 0, 7, 0, 0]
    arena.close()


def test_a_gpu_hit_first_block_asks_the_room_from_the_next(p_arena, landing) -> None:
    d = _D(landing)
    made = [_blob(s) for s in range(10, 13)]
    blobs = [b for b, _, _ in made]

    def body(port: int) -> None:
        room = RemoteBlocks("127.0.0.1", port, 32, LAYOUT.blob_nbytes, tuple(_digest(b) for b in blobs))
        assert d.receiver.receive([2, 3], [7, 8], room, 1)[1:] == ([], None)

    _with_p(p_arena, {32: blobs}, body)
    assert d.holds(2, *made[1][1:]) and d.holds(3, *made[2][1:]) and d.untouched([0, 1, 4, 5])
    assert d.tags() == [0, 0, 7, 8, 0, 0]


def test_a_block_corrupted_in_p_store_ends_the_load_there_and_keeps_no_tag_after_it(p_arena, landing) -> None:
    """P's stored blob 1 has a flipped byte (its own trailer no longer matches): it lands, D's check
    refuses it, block 0 counts, blocks 1 and 2 are computed (their tags stay the engine's business).
    Landing, the refused blocks never reach D's blocks at all."""
    d = _D(landing)
    made = [_blob(s) for s in range(20, 23)]
    blobs = [b for b, _, _ in made]
    digests = tuple(_digest(b) for b in blobs)
    bad = bytearray(blobs[1])
    bad[100] ^= 0x01
    blobs[1] = bytes(bad)

    def body(port: int) -> None:
        room = RemoteBlocks("127.0.0.1", port, 33, LAYOUT.blob_nbytes, digests)
        _, failed, error = d.receiver.receive([0, 1, 2], [1, 2, 3], room, 0)
        assert failed == [1, 2] and error == "room 33: 1 of 3 blocks in place"

    _with_p(p_arena, {33: blobs}, body)
    assert d.holds(0, *made[0][1:]) and d.tags() == [1, 0, 0, 0, 0, 0]
    if landing:
        assert d.untouched([1, 2]) and d.copied == [[0]]


def test_clean_refusals_are_failed_loads_and_write_nothing(p_arena, landing) -> None:
    d = _D(landing)
    blobs = [_blob(30)[0]]
    digests = (_digest(blobs[0]),)

    def body(port: int) -> None:
        unknown = RemoteBlocks("127.0.0.1", port, 99, LAYOUT.blob_nbytes, digests)  # P holds no room 99
        _, failed, error = d.receiver.receive([0], [1], unknown, 0)
        assert failed == [0] and "answered 404" in error
        other_layout = RemoteBlocks("127.0.0.1", port, 34, LAYOUT.blob_nbytes + 4, digests)
        _, failed, error = d.receiver.receive([0], [1], other_layout, 0)
        assert failed == [0] and "another model, dtype, block size or TP size" in error

    _with_p(p_arena, {34: blobs}, body)
    with socket.socket() as s:  # a port nobody listens on: refused before anything was sent
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    _, failed, error = d.receiver.receive([0], [1], RemoteBlocks("127.0.0.1", closed, 35, LAYOUT.blob_nbytes,
                                                                 digests), 0)
    assert failed == [0] and "unreachable" in error
    assert d.untouched(list(range(NUM_BLOCKS))) and d.tags() == [0] * NUM_BLOCKS
    assert d.copied == [] and (not landing or d.receiver._regions == [])


def test_a_transfer_whose_end_is_unknown_raises_for_the_ctm_to_exit(landing) -> None:
    """P took the request and never answered: its writes could still land later, so no ack may be given.
    Landing, the buffer stays registered and alive: a late write lands there, never in freed memory."""
    d = _D(landing)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(listener.accept()[0]), daemon=True).start()
    room = RemoteBlocks("127.0.0.1", listener.getsockname()[1], 36, LAYOUT.blob_nbytes, (1,), timeout_s=0.5)
    with pytest.raises(PeerWriteUnknown, match="room 36: the transfer's end is unknown"):
        d.receiver.receive([0], [1], room, 0)
    assert len(d.receiver._kept) == (1 if landing else 0) and d.copied == []
    for s in [*held, listener]:
        s.close()


def test_a_write_the_target_engine_refuses_counts_no_block_and_a_piece_outside_its_blob_is_refused(p_arena) -> None:
    """One batch per room: D's engine refuses a piece outside what it registered, the whole room fails
    (a batch does not say which piece did), and P never reads past a blob for a hostile offset."""
    d = _D()
    blob = _blob(40)[0]
    good = [[off, mem.nbytes, int(mem.ctypes.data)] for off, mem in d.receiver._pieces(0)]
    outside = KvTarget(41, d.receiver.segment, 0, [good[:-1] + [[good[-1][0], good[-1][1], 4096]]])
    written = asyncio.run(write_pieces(p_arena, [OutboxBlob.of(blob)], outside))
    assert written.num_written == 0 and "failed (code" in written.error
    past_blob = KvTarget(41, d.receiver.segment, 0, [[[len(blob) - 4, 16, good[0][2]]]])
    written = asyncio.run(write_pieces(p_arena, [OutboxBlob.of(blob)], past_blob))
    assert written == KvWritten(41, 0, "block 0: a piece lies outside its blob") and p_arena.used_bytes == 0
    assert asyncio.run(write_pieces(p_arena, [OutboxBlob.of(blob)], KvTarget(41, d.receiver.segment, 1, [good]))) == (
        KvWritten(41, 0))
