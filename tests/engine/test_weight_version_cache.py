"""A new weight version re-roots the prefix cache: nothing cached before it is hit after it, a request
in flight across it never caches its mixed blocks, and a flush forgets every prefix but keeps owners."""

from __future__ import annotations

from test_scheduler import make, req, step

from fastdeploy_r3.cache_manager.block_hash import root_hash
from fastdeploy_r3.engine.request import RequestStatus


def test_no_block_of_the_old_version_is_hit_after_reset_root():
    """Block size 4: 'a' caches blocks 0, 1; after the update, 'b' with the same prompt hits nothing."""
    s = make(16)
    a = req("a", list(range(9)), max_tokens=1)
    s.add_request(a)
    step(s)
    s.release(a, RequestStatus.FINISHED_LENGTH)
    assert s.kv.find_cached_prefix(req("probe", list(range(9)))).num_blocks == 2
    s.kv.reset_root(root_hash("t", "1"))
    b = req("b", list(range(9)), max_tokens=1)
    s.add_request(b)
    assert step(s) == [("b", 9, True)]
    assert b.num_cached_tokens == 0
    s.release(b, RequestStatus.FINISHED_LENGTH)
    assert s.kv.find_cached_prefix(req("probe", list(range(9)))).num_blocks == 2  # b's blocks, new root


def test_a_request_in_flight_across_an_update_never_caches_its_blocks():
    s = make(16)
    a = req("a", list(range(6)), max_tokens=8)
    s.add_request(a)
    step(s)  # blocks [0, 1]: block 0 full and cached
    s.kv.reset_root(root_hash("t", "1"))
    for _ in range(4):
        step(s)  # 'a' fills block 1 (positions 4..7) with KV of both versions
    assert a.num_computed_tokens == 10
    s.release(a, RequestStatus.FINISHED_LENGTH)
    assert s.kv.find_cached_prefix(req("probe", a.all_token_ids)).num_blocks == 0


def test_flush_forgets_prefixes_but_keeps_blocks_in_use():
    s = make(16)
    a = req("a", list(range(9)), max_tokens=4)
    s.add_request(a)
    step(s)
    assert s.kv.flush() == 2
    assert s.kv.block_table("a") == [0, 1, 2]
    assert s.kv.find_cached_prefix(req("probe", list(range(9)))).num_blocks == 0
    step(s)
    s.kv.check_integrity()
