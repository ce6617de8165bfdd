"""The mooncake backend's pieces on P's side without servers: the arena's allocator, the messages, a
write to a dead peer, and P's bootstrap routes (a room's manifest, the transfer's checks). The writes
into D's engine blocks themselves: tests/cache_manager/test_pd_receive.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fastdeploy_r3.cache_manager.pd_receive import KvTarget, KvWritten
from fastdeploy_r3.entrypoints.pd.te_in_place import write_pieces
from fastdeploy_r3.entrypoints.pd.te_transfer import Extents, Manifest, Outbox, OutboxBlob, TeArena, TeError

BLOB = 96  # bytes per block blob in these tests


def _blobs(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOB, dtype=np.uint8).tobytes() for _ in range(n)]


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
    m = Manifest(7, BLOB, [11, 12, 13], tail_tokens=3)  # two full blocks, then a partial one of 3 tokens
    assert Manifest.from_json(m.to_json()) == m
    assert KvWritten.from_json(KvWritten(7, 1, "x").to_json()) == KvWritten(7, 1, "x")
    for bad in ({"room": 7}, {"room": 7, "blob_nbytes": 0, "block_digests": [11], "tail_tokens": 0}, [1],
                {"room": 7, "blob_nbytes": BLOB, "block_digests": [], "tail_tokens": 3}):
        with pytest.raises(TeError, match="malformed manifest|blob_nbytes 0|tail_tokens 3 and 0 blocks"):
            Manifest.from_json(bad)


def test_the_outbox_keeps_rooms_by_reference_up_to_a_count_and_a_ttl() -> None:
    """P's outbox holds no block bytes (a room is read again from P's store when D asks): it is bounded by
    a number of rooms, the oldest leaving first, and by their age."""
    outbox = Outbox(ttl_s=3600, max_rooms=2)
    for room in (1, 2, 3):
        outbox.put(room, [OutboxBlob.of(b) for b in _blobs(2, room)])
    assert (outbox.manifest(1), len(outbox)) == (None, 2)
    assert outbox.manifest(3) == Manifest(3, BLOB, [int.from_bytes(b[-8:], "little") for b in _blobs(2, 3)])
    outbox.put(4, [OutboxBlob.of(b) for b in _blobs(2, 4)], tail_tokens=1)  # its last block a partial one
    assert outbox.manifest(4).tail_tokens == 1 and outbox.manifest(3).tail_tokens == 0
    stale = Outbox(ttl_s=-1.0)  # a negative TTL: every room is too old as it is put, so none stays
    stale.put(1, [])
    assert len(stale) == 0


def test_a_write_to_a_dead_peer_fails_with_a_clear_error_and_frees_p_arena() -> None:
    p, dead = TeArena(1 << 12), TeArena(4096)
    segment, base = dead.segment, dead.base
    dead.close()
    target = KvTarget(3, "127.0.0.1:1", 0, [[[0, BLOB, base]], [[0, BLOB, base + BLOB]]])
    written = asyncio.run(write_pieces(p, [OutboxBlob.of(b) for b in _blobs(2, 2)], target))
    assert (written.num_written, p.used_bytes) == (0, 0) and "transfer to 127.0.0.1:1 failed" in written.error
    assert segment != "127.0.0.1:1"
    p.close()


def test_the_transfer_route_refuses_a_bad_target_and_an_unknown_room_and_keeps_the_room() -> None:
    """P's /kv (pieces into D's engine blocks): a body that is not a target or names another room is a 400,
    a room not in the outbox a 404; neither takes the room. The manifest names each blob's own trailer."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from fastdeploy_r3.entrypoints.pd.te_in_place import add_in_place_route
    from fastdeploy_r3.entrypoints.pd.te_transfer import TeSender, add_te_routes

    outbox = Outbox()
    outbox.put(5, [OutboxBlob.of(b"x" * 16)])
    app = FastAPI()
    sender = TeSender(arena=None, outbox=outbox)  # type: ignore[arg-type]  # no route here reaches the arena
    add_te_routes(app, sender)
    add_in_place_route(app, sender)
    client = TestClient(app)
    assert client.get("/pd/rooms/5/manifest").json() == {"room": 5, "blob_nbytes": 16,
                                                          "block_digests": [int.from_bytes(b"x" * 8, "little")],
                                                          "tail_tokens": 0}
    assert client.get("/pd/rooms/6/manifest").status_code == 404
    targets = {"kv": {"room": 5, "segment": "127.0.0.1:1", "first": 0, "blocks": [[[0, 16, 0]]]}}
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
