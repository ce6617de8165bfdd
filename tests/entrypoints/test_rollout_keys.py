"""Rollout ids and store keys (issue 11, F5-F7): every valid id fits a file name, no id reaches
another request's, another layer's, another deployment's or the KV tier's entries."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import redis

from fastdeploy_r3.blobstore import open_blob_store
from fastdeploy_r3.r3.rollout_id import (
    MAX_CHOICES,
    MAX_ROLLOUT_ID_BYTES,
    InvalidRolloutIdError,
    choice_rollout_id,
    validate_namespace,
    validate_rollout_id,
)
from fastdeploy_r3.r3.stores import LocalRoutingStore, RedisRoutingStore

MOE_LAYER_IDS = [1, 2, 3]


def _rows(seed: int, t: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 8, size=(t, len(MOE_LAYER_IDS), 2), dtype=np.uint8)  # [T, L, K]


@pytest.mark.parametrize("fused", [True, False])
def test_f5_the_longest_valid_id_with_the_most_choices_fits_the_file_system(tmp_path, fused: bool) -> None:
    """F5: a 233-256 character id passed validation and then failed with 'File name too long'."""
    rid = "r" * MAX_ROLLOUT_ID_BYTES
    store = LocalRoutingStore(str(tmp_path), use_fused_put=fused)
    arrays = [_rows(i) for i in range(MAX_CHOICES)]
    store.put(rid, arrays, MOE_LAYER_IDS)
    assert np.array_equal(store.get(rid, choice=MAX_CHOICES - 1), arrays[-1])
    with pytest.raises(InvalidRolloutIdError, match=f"1-{MAX_ROLLOUT_ID_BYTES} characters"):
        validate_rollout_id("r" * (MAX_ROLLOUT_ID_BYTES + 1))


def test_f6_choice_ids_never_meet_another_requests_id(tmp_path) -> None:
    """F6: `coll` with n=2 and `coll_0` with n=1 overwrote each other."""
    store = LocalRoutingStore(str(tmp_path))
    two = [_rows(1), _rows(2)]
    store.put("coll", two, MOE_LAYER_IDS)
    store.put("coll_0", [_rows(3)], MOE_LAYER_IDS)
    assert sorted(os.listdir(tmp_path)) == ["coll#0.npy", "coll#1.npy", "coll_0.npy"]
    assert np.array_equal(store.get("coll", choice=0), two[0])
    assert np.array_equal(store.get("coll_0"), _rows(3))
    with pytest.raises(InvalidRolloutIdError):
        validate_rollout_id(choice_rollout_id("coll", 0))  # a choice id is never a rollout id


def test_contains_sees_a_rollout_stored_with_any_n_fused_or_per_layer(tmp_path) -> None:
    fused = LocalRoutingStore(str(tmp_path / "f"))
    per_layer = LocalRoutingStore(str(tmp_path / "l"), use_fused_put=False)
    fused.put("a", [_rows(0), _rows(1)], MOE_LAYER_IDS)
    per_layer.put("b", [_rows(0)], MOE_LAYER_IDS)
    assert fused.contains("a", MOE_LAYER_IDS) and not fused.contains("a_0", MOE_LAYER_IDS)
    assert per_layer.contains("b", MOE_LAYER_IDS) and not per_layer.contains("b.layers", MOE_LAYER_IDS)


def test_local_per_layer_directory_and_fused_file_of_two_ids_do_not_collide(tmp_path) -> None:
    """Before: rid 'x.npy' per layer made a directory 'x.npy/', the very name of rid 'x''s fused file."""
    fused, per_layer = LocalRoutingStore(str(tmp_path)), LocalRoutingStore(str(tmp_path), use_fused_put=False)
    fused.put("x", [_rows(1)], MOE_LAYER_IDS)
    per_layer.put("x.npy", [_rows(2)], MOE_LAYER_IDS)
    assert np.array_equal(fused.get("x"), _rows(1))
    assert np.array_equal(per_layer.get("x.npy", moe_layer_ids=MOE_LAYER_IDS), _rows(2))


def test_local_store_files_are_0600_and_new_directories_0700(tmp_path) -> None:
    old = os.umask(0o022)
    try:
        LocalRoutingStore(str(tmp_path / "s"), use_fused_put=False).put("p", [_rows(0)], MOE_LAYER_IDS)
    finally:
        os.umask(old)
    layer_dir = tmp_path / "s" / "p.layers"
    assert stat.S_IMODE(os.stat(layer_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(layer_dir / "layer_1.npy").st_mode) == 0o600


@pytest.mark.parametrize("namespace", ["fdr3:kv", "a/b", "a:b", "..", ""])
def test_namespaces_cannot_hold_a_key_separator(namespace: str) -> None:
    with pytest.raises(InvalidRolloutIdError, match="namespace"):
        validate_namespace(namespace)


def test_f7_a_rollout_id_shaped_like_a_kv_key_does_not_touch_the_kv_tier(redis_url: str) -> None:
    """F7: rollout id `kv:<ns>:<hash>` overwrote KV-storage blocks in the same Redis DB."""
    kv = open_blob_store(redis_url, "model|v0")
    kv_key = kv.blobs.key_prefix + "ab" * 16
    r = redis.Redis.from_url(redis_url)
    r.set(kv_key, b"kv-block")
    store = RedisRoutingStore(redis_url, "fdr3", ttl_s=60)
    rid = kv_key.removeprefix("fdr3:")  # the id that reached the KV key before: `fdr3` + ':' + rid
    assert rid.startswith("kv:")
    written = store.put(rid, [_rows(4)], MOE_LAYER_IDS)
    assert written == [f"fdr3/{rid}"] and r.get(kv_key) == b"kv-block"
    kv.close()
    store.close()


def test_f7_one_ids_layer_key_is_never_another_ids_fused_key(redis_url: str) -> None:
    """Before: `{ns}:{rid}:{layer}` of rid 'a:1' was the fused `{ns}:{rid}` of rid 'a:1:2'."""
    per_layer = RedisRoutingStore(redis_url, "nsx", ttl_s=60, use_fused_put=False)
    fused = RedisRoutingStore(redis_url, "nsx", ttl_s=60)
    per_layer.put("a:1", [_rows(5)], MOE_LAYER_IDS)
    fused.put("a:1:2", [_rows(6)], MOE_LAYER_IDS)
    assert np.array_equal(per_layer.get("a:1", moe_layer_ids=MOE_LAYER_IDS), _rows(5))
    assert np.array_equal(fused.get("a:1:2"), _rows(6))
    # and another deployment sees neither
    assert not RedisRoutingStore(redis_url, "nsy", ttl_s=60).contains("a:1", MOE_LAYER_IDS)
    assert per_layer.contains("a:1", MOE_LAYER_IDS) and fused.contains("a:1:2", MOE_LAYER_IDS)
    per_layer.close()
    fused.close()
