"""The mooncake backend's transfer without servers: two Mooncake Transfer Engines over TCP on loopback
(P's arena and D's), P's bootstrap server with an outbox, and D pulling a room into its arena: the blobs
arrive byte for byte, a flipped byte is caught by the manifest's checksum, a dead peer ends the
transfer with an error, and D's reservation is freed whatever happened."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fastdeploy_r3.cache_manager.pd_receive import KvWritten
from fastdeploy_r3.entrypoints.pd.bootstrap import BootstrapServer, Rooms
from fastdeploy_r3.entrypoints.pd.te_transfer import (
    Extents,
    Manifest,
    Outbox,
    TeArena,
    TeError,
    TeSender,
    TeTarget,
    blob_checksum,
    pull_room,
    verified_blobs,
    write_room,
)

BLOB = 96  # bytes per block blob in these tests


def _blobs(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOB, dtype=np.uint8).tobytes() for _ in range(n)]


@pytest.fixture(scope="module")
def arenas() -> tuple[TeArena, TeArena]:
    p, d = TeArena(1 << 16), TeArena(1 << 16)
    yield p, d
    p.close()
    d.close()


def test_extents_allocate_first_fit_and_merge_on_free() -> None:
    e = Extents(100)
    a, b, c = e.alloc(30), e.alloc(30), e.alloc(30)
    assert (a, b, c, e.alloc(11)) == (0, 30, 60, None)
    e.free(b)
    assert e.alloc(31) is None and e.used_bytes == 60
    e.free(a)  # merges with b's range: 60 bytes at 0
    assert e.alloc(60) == 0
    e.free(0)
    e.free(c)
    assert (e.used_bytes, e.alloc(100)) == (0, 0)


def test_messages_survive_their_json_and_malformed_ones_are_refused() -> None:
    m = Manifest(7, BLOB, ["ab", "cd"])
    assert Manifest.from_json(m.to_json()) == m
    assert TeTarget.from_json(TeTarget(7, "127.0.0.1:1", [1, 2]).to_json()) == TeTarget(7, "127.0.0.1:1", [1, 2])
    assert KvWritten.from_json(KvWritten(7, 1, "x").to_json()) == KvWritten(7, 1, "x")
    for bad in ({"room": 7}, {"room": 7, "blob_nbytes": 0, "checksums": ["ab"]}, [1]):
        with pytest.raises(TeError, match="malformed manifest|blob_nbytes 0"):
            Manifest.from_json(bad)


def test_p_writes_blobs_into_d_arena_over_the_transfer_engine(arenas) -> None:
    p, d = arenas
    blobs = _blobs(3, 1)
    off = d.alloc(3 * BLOB)
    target = TeTarget(9, d.segment, [d.base + off + i * BLOB for i in range(3)])
    written = asyncio.run(write_room(p, blobs, target))
    assert written == KvWritten(9, 3) and p.used_bytes == 0
    manifest = Manifest(9, BLOB, [blob_checksum(b) for b in blobs])
    assert verified_blobs(d, off, manifest, 3) == blobs
    d.buf[off + BLOB + 5] ^= 0x01  # a flipped byte in the second block: only the first counts
    assert verified_blobs(d, off, manifest, 3) == blobs[:1]
    assert verified_blobs(d, off, manifest, 0) == []
    d.free(off)


def test_a_write_to_a_dead_peer_fails_with_a_clear_error(arenas) -> None:
    p, _ = arenas
    dead = TeArena(4096)
    segment, base = dead.segment, dead.base
    dead.close()
    written = asyncio.run(write_room(p, _blobs(2, 2), TeTarget(3, "127.0.0.1:1", [base, base + BLOB])))
    assert (written.num_written, p.used_bytes) == (0, 0) and "transfer to 127.0.0.1:1 failed" in written.error
    assert segment != "127.0.0.1:1"


def test_d_pulls_a_room_through_p_bootstrap_server(arenas) -> None:
    p, d = arenas
    blobs = _blobs(4, 3)

    async def run() -> None:
        outbox = Outbox()
        server = BootstrapServer(Rooms(), "127.0.0.1", 0, TeSender(p, outbox))
        try:
            outbox.put(11, blobs)
            outbox.put(12, _blobs(2, 4))
            assert await pull_room(d, "127.0.0.1", server.port, 11, 10.0) == blobs
            assert len(outbox) == 1 and d.used_bytes == 0  # the room is taken, D's reservation freed
            with pytest.raises(TeError, match="answered 404 for room 11's manifest"):  # pulled once only
                await pull_room(d, "127.0.0.1", server.port, 11, 10.0)
            outbox.put(13, [])  # P held none of the prompt's blocks: nothing to pull, nothing reserved
            assert await pull_room(d, "127.0.0.1", server.port, 13, 10.0) == []
        finally:
            await server.close()
        with pytest.raises(TeError, match="bootstrap 127.0.0.1:.* failed the transfer \\(ConnectError"):
            await pull_room(d, "127.0.0.1", server.port, 12, 2.0)
        assert d.used_bytes == 0

    asyncio.run(run())


def test_an_arena_too_small_for_the_room_refuses_it_by_name(arenas) -> None:
    p, _ = arenas
    small = TeArena(BLOB)

    async def run() -> None:
        outbox = Outbox()
        server = BootstrapServer(Rooms(), "127.0.0.1", 0, TeSender(p, outbox))
        try:
            outbox.put(21, _blobs(2, 5))
            with pytest.raises(TeError, match="no room for 2 blocks of 96 bytes.*--disaggregation-te-arena-mb"):
                await pull_room(small, "127.0.0.1", server.port, 21, 10.0)
        finally:
            await server.close()
            small.close()

    asyncio.run(run())


def test_the_target_engine_refuses_writes_outside_its_registered_arena(arenas) -> None:
    """A wrong (or hostile) TeTarget cannot make P scribble over D's memory: D's engine checks every
    write against what it registered, and P reports the failure instead."""
    p, d = arenas
    past_end = d.base + d.buf.nbytes - BLOB // 2  # starts inside, ends outside
    for address in (past_end, 4096):
        written = asyncio.run(write_room(p, _blobs(1, 6), TeTarget(5, d.segment, [address])))
        assert written.num_written == 0 and "failed (code" in written.error
    assert p.used_bytes == 0


def test_blobs_scattered_at_d_arrive_each_at_its_address(arenas) -> None:
    """D reserves a room in one range (one write); blobs at addresses that are not contiguous still land
    each where D said, and a failing run stops the room at its first blob."""
    p, d = arenas
    blobs = _blobs(3, 7)
    off = d.alloc(5 * BLOB)
    addresses = [d.base + off, d.base + off + BLOB, d.base + off + 4 * BLOB]  # two runs: [0, 1] and [2]
    assert asyncio.run(write_room(p, blobs, TeTarget(6, d.segment, addresses))) == KvWritten(6, 3)
    got = [d.buf[a - d.base:a - d.base + BLOB].tobytes() for a in addresses]
    assert got == blobs
    written = asyncio.run(write_room(p, blobs, TeTarget(6, d.segment, addresses[:2] + [4096])))
    assert written.num_written == 2 and "failed" in written.error
    d.free(off)


def test_both_transfer_routes_refuse_a_bad_target_and_an_unknown_room_and_keep_the_room() -> None:
    """P's /te (blobs into D's arena) and /kv (pieces into D's engine blocks) share their checks: a body that
    is not a target or names another room is a 400, a room not in the outbox a 404; neither takes the room."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from fastdeploy_r3.entrypoints.pd.te_in_place import add_in_place_route
    from fastdeploy_r3.entrypoints.pd.te_transfer import Outbox, TeSender, add_te_routes

    outbox = Outbox()
    outbox.put(5, [b"x" * 16])
    app = FastAPI()
    sender = TeSender(arena=None, outbox=outbox)  # type: ignore[arg-type]  # no route here reaches the arena
    add_te_routes(app, sender)
    add_in_place_route(app, sender)
    client = TestClient(app)
    targets = {"te": {"room": 5, "segment": "127.0.0.1:1", "addresses": [0]},
               "kv": {"room": 5, "segment": "127.0.0.1:1", "first": 0, "blocks": [[[0, 16, 0]]]}}  # fmt: skip
    for kind, target in targets.items():
        r = client.post(f"/pd/rooms/5/{kind}", content=b"not json")
        assert r.status_code == 400, kind
        r = client.post(f"/pd/rooms/5/{kind}", json={"room": 5})
        assert r.status_code == 400 and "malformed" in r.json()["error"], (kind, r.text)
        r = client.post(f"/pd/rooms/6/{kind}", json=target)
        assert r.status_code == 400 and r.json()["error"] == "target names room 5, the path 6", kind
        r = client.post(f"/pd/rooms/7/{kind}", json=target | {"room": 7})
        assert r.status_code == 404 and r.json()["error"] == "room 7 has no blocks here", kind
        assert outbox.manifest(5) is not None  # the room is still P's to send
