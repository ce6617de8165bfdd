"""DiskBudget: a directory store stays under its capacity (least recently used out first) and its age."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fastdeploy_r3.blobstore.disk_budget import DiskBudget
from fastdeploy_r3.blobstore.kv import FileStorageBackend
from fastdeploy_r3.r3.stores import LocalRoutingStore


def age(path: str, seconds: float) -> None:
    """Make `path` look `seconds` older (its mtime is the LRU clock)."""
    st = os.stat(path)
    os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))


def test_a_full_file_tier_drops_its_least_recently_used_blocks(tmp_path) -> None:
    """4 KiB capacity, 1 KiB blocks a..d stored in that order, a read since: e evicts b and c, not a."""
    store = FileStorageBackend(str(tmp_path), "m@v0", capacity_bytes=4096)
    for i, key in enumerate(["aa", "bb", "cc", "dd"]):
        store.put(key, bytes([i]) * 1024)
        age(store._files.path(store.blob_key(key)), 100 - i)  # a is the oldest write
    assert store.get("aa") == b"\x00" * 1024  # a read makes it the most recently used
    store.put("ee", b"\x04" * 1024)
    assert store.exists(["aa", "bb", "cc", "dd", "ee"]) == [True, False, False, True, True]
    assert (store.budget.counters.evicted, store.budget.counters.evicted_bytes) == (2, 2048)


def test_an_old_block_is_a_miss_and_gone(tmp_path) -> None:
    store = FileStorageBackend(str(tmp_path), "m@v0", ttl_s=60)
    store.put("aa", b"old")
    store.put("bb", b"new")
    age(store._files.path(store.blob_key("aa")), 61)
    assert store.get("aa") is None and store.get("bb") == b"new"
    assert store.exists(["aa", "bb"]) == [False, True]
    assert store.budget.counters.expired == 1


def test_a_full_local_r3_store_drops_whole_rollouts(tmp_path) -> None:
    """Per-layer rollouts of 3 files each; the capacity holds two: the least recently read goes, whole."""
    arr = np.zeros((100, 3, 4), dtype=np.uint8)  # [T, L, K]: 3 files of 400 bytes + header
    store = LocalRoutingStore(str(tmp_path), use_fused_put=False, capacity_bytes=3500)
    store.put("r1", [arr], [1, 2, 3])
    store.put("r2", [arr], [1, 2, 3])
    age(str(tmp_path / "r1.layers"), 50)
    age(str(tmp_path / "r2.layers"), 40)
    store.get("r1", moe_layer_ids=[1, 2, 3])  # r1 read: r2 is now the least recently used
    store.put("r3", [arr], [1, 2, 3])
    assert sorted(os.listdir(tmp_path)) == ["r1.layers", "r3.layers"]
    with pytest.raises(KeyError):
        store.get("r2", moe_layer_ids=[1, 2, 3])


def test_an_expired_rollout_is_not_served(tmp_path) -> None:
    arr = np.ones((4, 2, 2), dtype=np.uint8)
    store = LocalRoutingStore(str(tmp_path), ttl_s=3600)
    store.put("r", [arr], [1, 2])
    age(str(tmp_path / "r.npy"), 3601)
    with pytest.raises(KeyError, match="expired"):
        store.get("r")


def test_the_byte_count_follows_other_writers_at_each_rescan(tmp_path) -> None:
    budget = DiskBudget(str(tmp_path), capacity_bytes=2000, rescan_every=2)
    budget.admit(10)  # first measure: empty
    (tmp_path / "other").write_bytes(b"x" * 1500)  # another engine wrote this
    budget.admit(10)  # a rescan: sees 1500 bytes, still fits
    assert (tmp_path / "other").exists()
    budget.admit(600)  # 1500 + 20 + 600 > 2000: the other writer's file is the oldest entry
    assert not (tmp_path / "other").exists() and budget.counters.evicted == 1
