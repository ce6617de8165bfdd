"""The blob-store base under the KV storage tier and the R3 stores: atomic files, Redis, checksums, redaction."""

from __future__ import annotations

import os

import pytest
import redis

from fastdeploy_r3.blobstore.base import (
    BlobStoreError,
    ChecksumError,
    ChecksummedBlobStore,
    checksummed,
    redact_url,
    verify_checksum,
)
from fastdeploy_r3.blobstore.local import LocalBlobStore
from fastdeploy_r3.blobstore.redis import RedisBlobStore


def test_local_store_round_trip_leaves_no_temp_files(tmp_path) -> None:
    store = LocalBlobStore(str(tmp_path))
    assert store.get("a/b.npy") is None and store.exists(["a/b.npy"]) == [False]
    store.put_many({"a/b.npy": b"v1", "c": b"v2"})
    store.put("a/b.npy", b"v3")
    assert store.get_many(["a/b.npy", "c", "d"]) == [b"v3", b"v2", None]
    store.delete(["c", "never-there"])
    assert store.exists(["a/b.npy", "c"]) == [True, False]
    assert sorted(os.listdir(tmp_path / "a")) == ["b.npy"]


def test_local_store_errors_are_typed(tmp_path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(BlobStoreError, match="cannot write"):
        LocalBlobStore(str(tmp_path)).put("file/below-a-file", b"v")  # a file where a directory must be


def test_redis_store_ttl_prefix_and_transactional_put(redis_url: str) -> None:
    store = RedisBlobStore(redis_url, "blobtest:")
    store.ping()
    store.put_many({"k1": b"a", "k2": b"b"}, ttl_s=50)
    r = redis.Redis.from_url(redis_url)
    assert r.get("blobtest:k1") == b"a" and 0 < r.ttl("blobtest:k2") <= 50
    assert store.get_many(["k1", "k2", "k3"]) == [b"a", b"b", None]
    assert store.exists(["k1", "k3"]) == [True, False]
    store.delete(["k1", "k2"])
    assert r.exists("blobtest:k1", "blobtest:k2") == 0
    store.close()


def test_redis_errors_redact_the_password() -> None:
    store = RedisBlobStore("redis://trainer:s3cret@127.0.0.1:1/0", connect_timeout_s=1)
    for call in (store.ping, lambda: store.get("k"), lambda: store.put("k", b"v")):
        with pytest.raises(BlobStoreError) as info:
            call()
        assert "s3cret" not in str(info.value) and "redis://trainer:***@127.0.0.1:1/0" in str(info.value)
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


def test_checksum_trailer_catches_a_flipped_bit_and_truncation() -> None:
    blob = checksummed([b"header", memoryview(b"payload")])
    assert bytes(verify_checksum(blob)) == b"headerpayload"
    bad = bytearray(blob)
    bad[3] ^= 0x01
    with pytest.raises(ChecksumError, match="corrupt"):
        verify_checksum(bytes(bad))
    with pytest.raises(ChecksumError, match="truncated"):
        verify_checksum(blob[:5])


def test_checksummed_store_adds_eight_bytes_and_never_returns_a_corrupt_value(tmp_path) -> None:
    """Over a local directory: values round-trip, each file is the value plus its 8-byte xxh3_64, a
    flipped byte or a cut file is a ChecksumError naming the key, and a missing key is still None."""
    inner = LocalBlobStore(str(tmp_path))
    store = ChecksummedBlobStore(inner)
    store.put_many({"a": b"abcdef", "b": b"xyz"})
    assert store.get_many(["a", "b", "c"]) == [b"abcdef", b"xyz", None]
    assert len(inner.get("a")) == 6 + 8 and inner.get("a")[:6] == b"abcdef"
    flipped = bytearray(inner.get("a"))
    flipped[2] ^= 0x01
    inner.put("a", bytes(flipped))
    inner.put("b", inner.get("b")[:-1])
    for key in ("a", "b"):
        with pytest.raises(ChecksumError, match=f"value of '{key}'"):
            store.get(key)
    store.delete(["a", "b"])
    assert store.exists(["a", "b"]) == [False, False]
