"""Routing stores: key validation, local files and a real redis-server, round-tripped through the client readers."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import redis
from mooncake_server import flush_all, mooncake_master, mooncake_url, raw_client

from fastdeploy_r3.client import (
    decode_fastdeploy_routing,
    read_fastdeploy_rollout,
    read_local_rollout,
    read_mooncake_rollout,
    read_redis_rollout,
)
from fastdeploy_r3.r3.codec import RoutedExpertsDecodeError
from fastdeploy_r3.r3.config import RoutingReplayConfig
from fastdeploy_r3.r3.rollout_id import InvalidRolloutIdError, previous_turn_rollout_id, validate_rollout_id
from fastdeploy_r3.r3.stores import LocalRoutingStore, RedisRoutingStore, RoutingStoreError, make_routing_store
from fastdeploy_r3.r3.stores.mooncake import MooncakeRoutingStore

MOE_LAYER_IDS = [1, 2, 3]  # layer 0 dense, as in GLM's first_k_dense_replace


def _rows(seed: int, t: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 8, size=(t, len(MOE_LAYER_IDS), 2), dtype=np.uint8)  # [T, L, K]


@pytest.mark.parametrize("rid", ["user", "d:3:0:1", "a.b-c_d", "x" * 200])
def test_valid_rollout_ids(rid: str) -> None:
    assert validate_rollout_id(rid) == rid


@pytest.mark.parametrize("rid", ["", "../etc", "a/b", "..", ".", "x" * 201, "a b", "k*", "é", "a#0", "x/y"])
def test_invalid_rollout_ids(rid: str) -> None:
    with pytest.raises(InvalidRolloutIdError):
        validate_rollout_id(rid)


def test_previous_turn_only_for_int_turn_and_segment() -> None:
    assert previous_turn_rollout_id("data7:gen2:3:1") == "data7:gen2:2:1"
    assert previous_turn_rollout_id("a:b:c:3:1") == "a:b:c:2:1"
    assert previous_turn_rollout_id("data:gen:0:1") is None  # first turn has no predecessor
    assert previous_turn_rollout_id("data:gen:x:1") is None
    assert previous_turn_rollout_id("gen:3:1") is None  # not data:gen:turn:segment
    assert previous_turn_rollout_id("user") is None


def test_local_fused_and_per_layer_round_trip(tmp_path) -> None:
    fused = LocalRoutingStore(str(tmp_path / "fused"), use_fused_put=True)
    a, b = _rows(0), _rows(1)
    paths = fused.put("r1", [a, b], MOE_LAYER_IDS)
    assert [os.path.basename(p) for p in paths] == ["r1#0.npy", "r1#1.npy"]
    assert np.load(paths[0]).shape == (3, 7, 2)  # fused [L, T, K]
    assert np.array_equal(read_local_rollout(str(tmp_path / "fused"), "r1", choice=1), b)
    assert not [n for n in os.listdir(tmp_path / "fused") if ".tmp." in n]  # no temp files left

    per_layer = LocalRoutingStore(str(tmp_path / "layers"), use_fused_put=False)
    per_layer.put("r2", [a], MOE_LAYER_IDS)
    assert sorted(os.listdir(tmp_path / "layers" / "r2.layers")) == ["layer_1.npy", "layer_2.npy", "layer_3.npy"]
    assert np.array_equal(read_local_rollout(str(tmp_path / "layers"), "r2"), a)
    assert np.array_equal(read_local_rollout(str(tmp_path / "layers"), "r2", moe_layer_ids=[3]), a[:, 2:3])


def test_local_only_last_turn_deletes_previous_turn(tmp_path) -> None:
    store = LocalRoutingStore(str(tmp_path), only_last_turn=True)
    store.put("d:g:0:0", [_rows(0)], MOE_LAYER_IDS)
    store.put("d:g:0:1", [_rows(1)], MOE_LAYER_IDS)
    store.put("d:g:1:0", [_rows(2)], MOE_LAYER_IDS)
    assert sorted(os.listdir(tmp_path)) == ["d:g:0:1.npy", "d:g:1:0.npy"]  # other segment untouched


def test_make_routing_store_by_type(tmp_path) -> None:
    assert make_routing_store(RoutingReplayConfig(enable_routing_replay=True), "ns") is None
    cfg = RoutingReplayConfig(enable_routing_replay=True, routing_store_type="local", local_store_dir=str(tmp_path))
    assert isinstance(make_routing_store(cfg, "ns"), LocalRoutingStore)


def test_redis_fused_ttl_and_namespace(redis_url: str) -> None:
    store = RedisRoutingStore(redis_url, "ns1", ttl_s=120)
    store.ping()
    a, b = _rows(3), _rows(4)
    assert store.put("d:g:0:0", [a, b], MOE_LAYER_IDS) == ["ns1/d:g:0:0#0", "ns1/d:g:0:0#1"]
    r = redis.Redis.from_url(redis_url)
    assert 0 < r.ttl("ns1/d:g:0:0#0") <= 120
    assert np.array_equal(read_redis_rollout(redis_url, "ns1", "d:g:0:0", choice=1), b)
    store.close()


def test_redis_per_layer_only_last_turn_and_no_wipe(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    r.set("ns2/someone-else", b"keep")
    store = RedisRoutingStore(redis_url, "ns2", ttl_s=60, use_fused_put=False, only_last_turn=True)
    a, b = _rows(5), _rows(6, t=9)
    assert store.put("d:g:0:4", [a], MOE_LAYER_IDS) == [f"ns2/d:g:0:4/layer_{i}" for i in MOE_LAYER_IDS]
    assert np.array_equal(read_redis_rollout(redis_url, "ns2", "d:g:0:4", moe_layer_ids=MOE_LAYER_IDS), a)
    store.put("d:g:1:4", [b], MOE_LAYER_IDS)
    assert r.exists("ns2/d:g:0:4/layer_1", "ns2/d:g:0:4/layer_2", "ns2/d:g:0:4/layer_3") == 0  # previous turn gone
    assert np.array_equal(read_redis_rollout(redis_url, "ns2", "d:g:1:4", moe_layer_ids=MOE_LAYER_IDS), b)
    assert r.get("ns2/someone-else") == b"keep"
    # a second store on the same server (a restart) does not wipe anything
    RedisRoutingStore(redis_url, "ns2", ttl_s=60).ping()
    assert r.exists("ns2/d:g:1:4/layer_1") == 1
    store.close()


def test_redis_put_to_dead_server_raises() -> None:
    store = RedisRoutingStore("redis://127.0.0.1:1/0", "ns", ttl_s=60)
    with pytest.raises(RoutingStoreError, match="127.0.0.1:1"):
        store.put("user", [_rows(0)], MOE_LAYER_IDS)


def test_redis_errors_never_show_the_password() -> None:
    store = RedisRoutingStore("redis://trainer:s3cret@127.0.0.1:1/0", "ns", ttl_s=60)
    with pytest.raises(RoutingStoreError) as info:
        store.put("r", [_rows(0)], MOE_LAYER_IDS)
    assert "s3cret" not in str(info.value) and "trainer:***@127.0.0.1:1" in str(info.value)
    with pytest.raises(RoutingStoreError) as info:
        store.ping()
    assert "s3cret" not in str(info.value)


# -- the real server in p2pstore mode ---------------------------------------------------------------


@pytest.fixture(scope="module")
def p2p_server(redis_url: str, tmp_path_factory):
    from api_server_process import api_server
    from fake_model import make_fake_model

    model_dir = make_fake_model("glm4_moe", str(tmp_path_factory.mktemp("glm")))
    cfg = {"enable_routing_replay": True, "routing_store_type": "p2pstore", "p2pstore_url": redis_url,
           "use_fused_put": False, "only_last_turn": True, "ttl_s": 300}
    with api_server(model_dir, str(tmp_path_factory.mktemp("logs")), "--routing-replay-config", json.dumps(cfg),
                    "--r3-namespace", "e2e") as handle:
        yield handle


def test_server_puts_r3_per_layer_in_redis_before_answering(p2p_server, redis_url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{p2p_server.url}/v1", api_key="none", max_retries=0)
    r = redis.Redis.from_url(redis_url)
    first = client.completions.create(model=client.models.list().data[0].id, prompt="turn zero", max_tokens=4,
                                      temperature=0, extra_body={"rollout_id": "d7:g1:0:0", "ignore_eos": True})
    assert first.choices[0].routed_experts is None and first.moe_layer_ids == MOE_LAYER_IDS
    arr = read_redis_rollout(redis_url, "e2e", "d7:g1:0:0", moe_layer_ids=MOE_LAYER_IDS)
    assert arr.shape == (first.usage.prompt_tokens + 4 - 1, 3, 4)
    assert 0 < r.ttl("e2e/d7:g1:0:0/layer_1") <= 300

    # next turn, n=2: suffixed keys, and only_last_turn removes the previous turn's keys
    second = client.completions.create(model=first.model, prompt="turn one", max_tokens=3, n=2, temperature=1.0,
                                       seed=3, extra_body={"rollout_id": "d7:g1:1:0", "ignore_eos": True})
    for i in range(2):
        got = read_redis_rollout(redis_url, "e2e", "d7:g1:1:0", choice=i, moe_layer_ids=MOE_LAYER_IDS)
        assert got.shape == (second.usage.prompt_tokens + 3 - 1, 3, 4)
    assert r.exists(*[f"e2e/d7:g1:0:0/layer_{layer}" for layer in MOE_LAYER_IDS]) == 0

    # without rollout_id the `user` field is the key; without either, the request id (never a constant)
    client.completions.create(model=first.model, prompt="anon", max_tokens=2, temperature=0, user="alice")
    assert r.exists("e2e/alice/layer_1") == 1
    anon = [client.completions.create(model=first.model, prompt="anon", max_tokens=2, temperature=0) for _ in "ab"]
    assert anon[0].id != anon[1].id
    assert r.exists(*[f"e2e/{a.id}/layer_{layer}" for a in anon for layer in MOE_LAYER_IDS]) == 2 * len(MOE_LAYER_IDS)
    assert r.exists("e2e/user/layer_1") == 0
    bad = client.with_options(max_retries=0)
    with pytest.raises(openai.BadRequestError, match="user"):
        bad.completions.create(model=first.model, prompt="anon", max_tokens=2, user="not a key/")


def test_get_of_a_missing_rollout_is_a_key_error(tmp_path, redis_url: str, mooncake_store_url: str) -> None:
    with pytest.raises(KeyError):
        read_local_rollout(str(tmp_path), "never-written")
    with pytest.raises(KeyError):
        read_redis_rollout(redis_url, "ns3", "never-written", moe_layer_ids=MOE_LAYER_IDS)
    with pytest.raises(KeyError):
        read_mooncake_rollout(mooncake_store_url, "ns3", "never-written", moe_layer_ids=MOE_LAYER_IDS)


# -- Mooncake: the same store contract on a real mooncake_master ---------------------------------------------


def _master(url: str) -> str:
    return url.split("://", 1)[1].split("?", 1)[0]


def test_mooncake_fused_per_layer_only_last_turn_and_no_wipe(mooncake_store_url: str) -> None:
    flush_all(mooncake_store_url)
    raw = raw_client(_master(mooncake_store_url))
    raw.upsert("mc1:someone-else", b"keep")
    fused = MooncakeRoutingStore(mooncake_store_url, "mc1")
    a, b = _rows(3), _rows(4)
    assert fused.put("d:g:0:0", [a, b], MOE_LAYER_IDS) == ["mc1/d:g:0:0#0", "mc1/d:g:0:0#1"]
    assert np.array_equal(read_mooncake_rollout(mooncake_store_url, "mc1", "d:g:0:0", choice=1), b)

    per_layer = MooncakeRoutingStore(mooncake_store_url, "mc1", use_fused_put=False, only_last_turn=True)
    c, d = _rows(5), _rows(6, t=9)
    layer_keys = ["mc1/d:g:0:4/layer_1", "mc1/d:g:0:4/layer_2", "mc1/d:g:0:4/layer_3"]
    assert per_layer.put("d:g:0:4", [c], MOE_LAYER_IDS) == layer_keys
    assert np.array_equal(read_mooncake_rollout(mooncake_store_url, "mc1", "d:g:0:4", moe_layer_ids=[1, 2, 3]), c)
    per_layer.put("d:g:1:4", [d], MOE_LAYER_IDS)  # next turn: the previous turn's keys go, even just read
    assert raw.batch_is_exist(layer_keys) == [0, 0, 0]
    assert np.array_equal(per_layer.get("d:g:1:4", moe_layer_ids=[1, 2, 3]), d)
    assert raw.get("mc1:someone-else") == b"keep"
    # the same rollout id stored again serves the new value, never the old one
    fused.put("d:g:0:0", [b, a], MOE_LAYER_IDS)
    assert np.array_equal(fused.get("d:g:0:0", choice=0), b)
    fused.close()
    per_layer.close()
    raw.close()


def test_mooncake_fastdeploy_keys_and_release_after_read(mooncake_store_url: str) -> None:
    """key_style=fastdeploy: `{rid}` fused and `{rid}_{layer}` per layer; release=True deletes after reading."""
    url = mooncake_store_url + "&key_style=fastdeploy"
    a = _rows(7)
    fused = MooncakeRoutingStore(url, "ignored")
    assert fused.put("fd-r1", [a], MOE_LAYER_IDS) == ["fd-r1"]
    per_layer = MooncakeRoutingStore(url, "ignored", use_fused_put=False)
    assert per_layer.put("fd-r2", [a], MOE_LAYER_IDS) == ["fd-r2_1", "fd-r2_2", "fd-r2_3"]
    assert np.array_equal(read_mooncake_rollout(url, "any", "fd-r1", release=True), a)
    with pytest.raises(KeyError, match="'fd-r1'"):
        read_mooncake_rollout(url, "any", "fd-r1")
    assert np.array_equal(read_mooncake_rollout(url, "any", "fd-r2", moe_layer_ids=[1, 2, 3], release=True), a)
    with pytest.raises(KeyError, match="'fd-r2_1'"):
        read_mooncake_rollout(url, "any", "fd-r2", moe_layer_ids=[1, 2, 3])
    fused.close()
    per_layer.close()


def test_mooncake_corrupt_r3_is_a_clear_error(mooncake_store_url: str) -> None:
    """A flipped byte or a truncated object under an R3 key is an error naming the key, never ids."""
    store = MooncakeRoutingStore(mooncake_store_url, "mc2")
    store.put("bad1", [_rows(8)], MOE_LAYER_IDS)
    raw = raw_client(_master(mooncake_store_url))
    good = raw.get("mc2/bad1")
    flipped = bytearray(good)
    flipped[-9] ^= 0x01  # the last expert id, just before the 8-byte checksum
    raw.upsert("mc2/bad1", bytes(flipped))
    raw.upsert("mc2/bad2", good[:-1])
    for rid in ("bad1", "bad2"):
        with pytest.raises(RoutedExpertsDecodeError, match=f"'mc2/{rid}'"):
            store.get(rid)
    raw.close()
    store.close()


def test_bad_mooncake_p2pstore_url_is_a_routing_store_error() -> None:
    with pytest.raises(RoutingStoreError, match="key_style='fd'; use one of"):
        MooncakeRoutingStore("mooncake://127.0.0.1:1?key_style=fd", "ns")
    with pytest.raises(RoutingStoreError, match="unreachable"):
        MooncakeRoutingStore("mooncake://127.0.0.1:1?protocol=tcp", "ns")


def test_mooncake_r3_of_an_exited_server_is_gone_not_stale() -> None:
    """No holder: the server's own segment holds R3, so after it closes a trainer gets KeyError."""
    with mooncake_master() as master:
        store = MooncakeRoutingStore(mooncake_url(master, segment="16MB"), "mc3")
        store.put("gone", [_rows(9)], MOE_LAYER_IDS)
        assert np.array_equal(read_mooncake_rollout(mooncake_url(master), "mc3", "gone"), _rows(9))
        store.close()
        with pytest.raises(KeyError, match="lost with the client"):
            read_mooncake_rollout(mooncake_url(master), "mc3", "gone")


def test_fastdeploy_bare_arrays_are_read_with_their_padding_dropped(mooncake_store_url: str) -> None:
    """What FastDeploy itself puts: bare int32 `[L, max_model_len, K]` (fused) or `[max_model_len, K]`
    per layer, padded with -1 rows; the reader returns `[T, L, K]` equal to the unpadded ids."""
    ids = _rows(10, t=5).astype(np.int32)  # [T=5, L=3, K=2]
    padded = np.full((3, 12, 2), -1, dtype=np.int32)  # [L, max_model_len=12, K]
    padded[:, :5] = ids.transpose(1, 0, 2)
    raw = raw_client(_master(mooncake_store_url))
    raw.upsert("fdpad", padded.tobytes())
    for j, layer in enumerate(MOE_LAYER_IDS):
        raw.upsert(f"fdpad_{layer}", padded[j].tobytes())
    url = mooncake_store_url + "&key_style=fastdeploy"
    assert np.array_equal(read_fastdeploy_rollout(url, "fdpad", MOE_LAYER_IDS, top_k=2), ids)
    assert np.array_equal(read_fastdeploy_rollout(url, "fdpad", MOE_LAYER_IDS, top_k=2, fused=False), ids)
    holed = padded.copy()
    holed[1, 2, 0] = -1
    with pytest.raises(RoutedExpertsDecodeError, match="inside the routed rows"):
        decode_fastdeploy_routing(holed.tobytes(), 3, 2)
    with pytest.raises(RoutedExpertsDecodeError, match="whole rows"):
        decode_fastdeploy_routing(padded.tobytes()[:-4], 3, 2)
    raw.close()
