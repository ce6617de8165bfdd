"""Storage backends and the block blob codec, without the CTM."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from mooncake_server import mooncake_master, mooncake_url, raw_client
from redis_server import redis_pid, redis_server

from fastdeploy_r3.blobstore import open_blob_store
from fastdeploy_r3.blobstore.kv import (
    FileStorageBackend,
    InvalidStorageKeyError,
    MooncakeStorageBackend,
    RedisStorageBackend,
    StorageError,
)
from fastdeploy_r3.blobstore.mooncake import MooncakeBlobStore
from fastdeploy_r3.cache_manager.storage import BlockDecodeError, BlockLayout, decode_block, encode_block

# 2 ranks, 3 layers, block_size 4, 2 kv heads, head dim 8, float32; R3 with L=2 MoE layers, K=2, uint8.
LAYOUT = BlockLayout(
    num_ranks=2, kv_shape=(3, 2, 4, 2, 8), kv_dtype="float32", kv_itemsize=4, rows_shape=(4, 2, 2), rows_dtype="uint8"
)


def _block(seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    kv = [rng.standard_normal(LAYOUT.kv_shape).astype(np.float32) for _ in range(LAYOUT.num_ranks)]
    rows = rng.integers(0, 64, size=LAYOUT.rows_shape, dtype=np.uint8)
    return kv, rows


def test_codec_roundtrip_is_bit_exact() -> None:
    kv, rows = _block(0)
    blob = encode_block(LAYOUT, kv, rows)
    assert len(blob) == LAYOUT.blob_nbytes
    got_kv, got_rows = decode_block(blob, LAYOUT)
    for want, got in zip(kv, got_kv, strict=True):
        assert got.tobytes() == want.tobytes()
    np.testing.assert_array_equal(got_rows, rows)


def test_codec_rejects_every_single_byte_flip_and_truncation() -> None:
    """Any flipped byte (header, KV, rows or checksum) and any truncation is a typed error, never data."""
    kv, rows = _block(1)
    blob = encode_block(LAYOUT, kv, rows)
    for pos in range(0, len(blob), 7):
        bad = bytearray(blob)
        bad[pos] ^= 0x40
        with pytest.raises(BlockDecodeError):
            decode_block(bytes(bad), LAYOUT)
    for cut in (0, 10, len(blob) // 2, len(blob) - 1):
        with pytest.raises(BlockDecodeError, match="truncated|shorter"):
            decode_block(blob[:cut], LAYOUT)


def test_codec_rejects_other_engine_layout() -> None:
    """A block stored by another TP size, dtype or R3 shape is a miss, not a reinterpretation."""
    kv, rows = _block(2)
    blob = encode_block(LAYOUT, kv, rows)
    other_tp = BlockLayout(1, (3, 2, 4, 4, 8), "float32", 4, (4, 2, 2), "uint8")
    other_k = BlockLayout(2, (3, 2, 4, 2, 8), "float32", 4, (4, 2, 4), "uint8")
    no_rows = BlockLayout(2, (3, 2, 4, 2, 8), "float32", 4)
    with pytest.raises(BlockDecodeError, match="KV layout"):
        decode_block(blob, other_tp)
    with pytest.raises(BlockDecodeError, match="routing rows"):
        decode_block(blob, other_k)
    with pytest.raises(BlockDecodeError, match="routing rows"):
        decode_block(encode_block(no_rows, kv, None), LAYOUT)
    # An engine with R3 off may use a block stored with rows: it only needs the KV.
    got_kv, got_rows = decode_block(blob, no_rows)
    assert got_rows is None and got_kv[1].tobytes() == kv[1].tobytes()


def _exercise_backend(store, other_namespace_store) -> None:
    key = "00ff" * 8
    assert store.get(key) is None
    assert store.exists([key, "ab"]) == [False, False]
    store.put(key, b"v1")
    store.put("ab", b"v2")
    store.put(key, b"v1")  # the same bytes again: a no-op
    with pytest.raises(StorageError, match=f"block {key} is stored with other bytes; stored blocks are immutable"):
        store.put(key, b"v3")
    assert store.get(key) == b"v1"  # nobody replaces what other engines load
    assert (store.counters.puts, store.counters.put_duplicates, store.counters.put_conflicts) == (2, 1, 1)
    assert store.exists([key, "ab", "cd"]) == [True, True, False]
    assert other_namespace_store.get(key) is None  # weights of another version never see it
    store.delete([key, "cd"])
    assert store.exists([key, "ab"]) == [False, True]
    for bad in ("../etc/passwd", "ABCD", "", "a" * 129, "12 34"):
        with pytest.raises(InvalidStorageKeyError):
            store.get(bad)


def test_file_backend(tmp_path) -> None:
    store = open_blob_store(f"file://{tmp_path}", "qwen3-moe@v1")
    assert isinstance(store, FileStorageBackend)
    _exercise_backend(store, open_blob_store(f"file://{tmp_path}", "qwen3-moe@v2"))
    assert not [p for p in tmp_path.rglob("*.tmp.*")]  # atomic writes leave no temp files
    # A new backend on the same directory keeps what is stored (never wiped on start).
    assert open_blob_store(f"file://{tmp_path}", "qwen3-moe@v1").get("ab") == b"v2"


def test_redis_backend(redis_url: str) -> None:
    store = open_blob_store(redis_url, "qwen3-moe@v1")
    assert isinstance(store, RedisStorageBackend)
    _exercise_backend(store, open_blob_store(redis_url, "qwen3-moe@v2"))
    assert open_blob_store(redis_url, "qwen3-moe@v1").get("ab") == b"v2"
    store.delete(["ab"])


def test_bad_urls_and_namespace_say_what_to_do(tmp_path) -> None:
    with pytest.raises(StorageError, match="file:///absolute/dir"):
        open_blob_store("s3://bucket/x", "m@v1")
    with pytest.raises(StorageError, match="weight version"):
        open_blob_store(f"file://{tmp_path}", "")
    with pytest.raises(StorageError, match="unreachable"):
        open_blob_store("redis://127.0.0.1:1/0", "m@v1")
    with pytest.raises(StorageError, match="unreachable"):
        open_blob_store("mooncake://127.0.0.1:1?protocol=tcp", "m@v1")
    with pytest.raises(StorageError, match=r"unknown parameter\(s\) \['segmnt'\]"):
        open_blob_store("mooncake://127.0.0.1:1?segmnt=0", "m@v1")
    with pytest.raises(StorageError, match="at least 16MB"):
        open_blob_store("mooncake://127.0.0.1:1?segment=8MB", "m@v1")
    with pytest.raises(StorageError, match="needs a master address"):
        open_blob_store("mooncake:///x", "m@v1")


def test_redis_backend_errors_never_show_the_password() -> None:
    with pytest.raises(StorageError, match="unreachable") as info:
        open_blob_store("redis://kv:hunter2@127.0.0.1:1/0", "m@v1")
    assert "hunter2" not in str(info.value)


# -- Mooncake: the same contract on a real mooncake_master, plus the ways its objects disappear ---------------


def test_mooncake_backend(mooncake_store_url: str) -> None:
    store = open_blob_store(mooncake_store_url, "qwen3-moe@v1")
    assert isinstance(store, MooncakeStorageBackend)
    _exercise_backend(store, open_blob_store(mooncake_store_url, "qwen3-moe@v2"))
    store.close()
    # The holder keeps the objects: a new client (a restarted engine) finds what the closed one put.
    again = open_blob_store(mooncake_store_url, "qwen3-moe@v1")
    assert again.get("ab") == b"v2"
    again.delete(["ab"])
    assert again.exists(["ab"]) == [False]
    again.close()


def test_mooncake_short_flipped_and_foreign_objects_are_misses(mooncake_store_url: str) -> None:
    """Objects under the backend's keys that are truncated, have one flipped byte, or are not block blobs
    come back as they are and fail the block codec (its checksum), so the loader counts them as misses."""
    store = open_blob_store(mooncake_store_url, "m@v1")
    kv, rows = _block(3)
    good = encode_block(LAYOUT, kv, rows)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01  # inside the KV bytes
    raw = raw_client(mooncake_store_url.split("://", 1)[1].split("?", 1)[0])
    try:
        for key, value in [("a1", good[:-3]), ("a2", bytes(flipped)), ("a3", b"not a block"), ("a4", good)]:
            assert raw.upsert(store.blob_key(key), value) == 0
        for key, why in [("a1", "truncated"), ("a2", "checksum mismatch"), ("a3", "truncated")]:
            with pytest.raises(BlockDecodeError, match=why):
                decode_block(store.get(key), LAYOUT)
        assert store.exists(["a1", "a2", "a3"]) == [True, True, True]  # present, yet never served as data
        got_kv, got_rows = decode_block(store.get("a4"), LAYOUT)
        assert got_kv[0].tobytes() == kv[0].tobytes() and np.array_equal(got_rows, rows)
    finally:
        raw.remove_all(True)
        raw.close()
        store.close()


def test_mooncake_objects_of_a_killed_producer_are_misses() -> None:
    """A producer with its own segment puts a block and is SIGKILLed: the master still lists the key
    (until client_ttl), but reading it is a miss, never stale or partial bytes."""
    with mooncake_master() as master:
        url = mooncake_url(master, segment="16MB")
        producer = (
            "import os, signal\n"
            "from fastdeploy_r3.blobstore import open_blob_store\n"
            f"store = open_blob_store({url!r}, 'm@v1')\n"
            "store.put('beef', b'x' * 1000)\n"
            "assert store.get('beef') == b'x' * 1000\n"
            "print('stored', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.run([sys.executable, "-c", producer], capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == -9 and "stored" in proc.stdout, proc.stderr[-2000:]
        reader = open_blob_store(mooncake_url(master, segment="0"), "m@v1")
        assert reader.get("beef") is None
        reader.close()


def test_mooncake_evicts_unpinned_blocks_silently_and_keeps_pinned_ones() -> None:
    """A 16 MB segment evicting above half full, one hard-pinned 1 MB object, then unpinned 1 MB blocks:
    some blocks that were stored are gone (misses, no error anywhere), the pinned object stays, and every
    block still there reads back whole."""
    with mooncake_master("--eviction_high_watermark_ratio=0.5") as master:
        store = open_blob_store(mooncake_url(master, segment="16MB"), "m@v1")
        pinner = MooncakeBlobStore(mooncake_url(master, segment="0"), pin=True)
        pinner.put(store.blob_key("0f"), b"p" * 2**20)
        stored: list[int] = []
        for i in itertools.count():  # 40 blocks, then more until the master's (asynchronous) eviction shows
            try:
                store.put(f"{i + 16:x}", bytes([i % 256]) * 2**20)  # 1 MB
                stored.append(i)
            except StorageError:
                time.sleep(0.01)  # segment full until the master evicts
            if i >= 39 and not all(store.exists([f"{j + 16:x}" for j in stored])):
                break
            assert i < 1000, "the master never evicted an unpinned block"
        # read through another client (another engine): the writer's own health may still be skipping the
        # store after its refused puts, which would make every read a miss for a few seconds
        reader = open_blob_store(mooncake_url(master, segment="0"), "m@v1")
        present = [i for i in stored if reader.get(f"{i + 16:x}") is not None]
        assert len(stored) > len(present) > 0, (stored, present)
        assert all(reader.get(f"{i + 16:x}") == bytes([i % 256]) * 2**20 for i in present)
        assert reader.get("0f") == b"p" * 2**20
        reader.close()
        pinner.close()


def test_a_stopped_redis_costs_one_timeout_then_is_skipped_until_it_answers() -> None:
    """F8 at the backend: Redis SIGSTOPped; the first call waits its 0.3 s timeout, the next ones none."""
    with redis_server() as url:
        store = open_blob_store(url, "qwen3-moe@v1", timeout_s=0.3)
        store.put("ab", b"block")
        store.health.retry_after_s = 0.5  # probe again after 0.5 s rather than 5 s
        pid = redis_pid(url)
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert store.exists(["ab"]) == [False]
            assert 0.25 < time.monotonic() - t0 < 2.0
            t1 = time.monotonic()
            assert store.get("ab") is None and store.exists(["ab"]) == [False]
            with pytest.raises(StorageError, match="not stored: kv storage degraded for"):
                store.put("cd", b"other")
            assert time.monotonic() - t1 < 0.1
        finally:
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.6)
        assert store.exists(["ab"]) == [True] and store.health.degraded is None
        store.close()
