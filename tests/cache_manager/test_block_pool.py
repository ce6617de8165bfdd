from __future__ import annotations

import pytest

from fastdeploy_r3.cache_manager.block_hash import hash_block_chain, root_hash
from fastdeploy_r3.cache_manager.block_pool import BlockPool, EvictedBlock, NoFreeBlocksError

H1, H2, H3 = b"h1" * 8, b"h2" * 8, b"h3" * 8
T1, T2 = (1, 2, 3, 4), (5, 6, 7, 8)  # token ids of a block of 4


def test_allocate_takes_lru_first_and_free_appends_in_given_order():
    """Four blocks: allocate 3, free them tail first; the next allocation takes the untouched block, then the tail."""
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert pool.free_block_ids() == [3]
    pool.free(list(reversed(a)))
    assert pool.free_block_ids() == [3, 2, 1, 0]
    assert [b.block_id for b in pool.allocate(2)] == [3, 2]
    pool.check_integrity()


def test_cached_free_block_is_revived_by_touch_and_evicted_when_popped():
    """Block 0 is cached then freed; a hit revives it; freed again it is evicted by the next allocation."""
    pool = BlockPool(2)
    (b0,) = pool.allocate(1)
    b0.routing_tag = 7
    assert pool.cache(b0, H1, T1)
    pool.free([b0])
    assert pool.lookup(H1, T1) is b0 and pool.free_block_ids() == [1, 0]
    pool.touch([b0])
    assert b0.ref_cnt == 1 and pool.free_block_ids() == [1]
    pool.free([b0])
    got = pool.allocate(2)
    assert [b.block_id for b in got] == [1, 0]
    assert pool.lookup(H1, T1) is None
    assert pool.pop_evicted() == [EvictedBlock(0, H1, T1, 7)]
    assert pool.pop_evicted() == []
    assert got[1].routing_tag == 0 and got[1].block_hash is None
    pool.check_integrity()


def test_shared_block_goes_free_only_after_last_owner():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.touch([b])
    pool.free([b])
    assert b.ref_cnt == 1 and 0 not in pool.free_block_ids()
    pool.free([b])
    assert pool.free_block_ids() == [1, 2, 0]
    pool.check_integrity()


def test_duplicate_hash_is_not_cached_twice_and_over_allocation_raises():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache(a, H2, T2)
    assert not pool.cache(b, H2, T2)
    assert b.block_hash is None and pool.lookup(H2, T2) is a
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.uncache(a)
    assert pool.lookup(H2, T2) is None
    pool.check_integrity()


def test_forced_hash_collision_is_a_miss_not_another_prompts_block():
    """Block 0 holds tokens 1..4 under H1; a request whose block 5..8 hashes to H1 too gets no hit."""
    pool = BlockPool(2)
    (b0,) = pool.allocate(1)
    assert pool.cache(b0, H1, T1)
    assert pool.lookup(H1, T2) is None  # same hash, other tokens: a collision
    assert pool.lookup(H1, list(T1)) is b0  # the block's own tokens still hit
    assert pool.cached_block(H1) is b0  # registered all along: the miss is the token check


def test_hash_chain_depends_on_prefix_model_and_weight_version():
    root = root_hash("qwen3", "v1")
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    h = hash_block_chain(root, toks, 4, 2)
    assert h == hash_block_chain(root, toks, 4, 2)
    assert h[0] == hash_block_chain(root, [1, 2, 3, 4, 9, 9, 9, 9], 4, 2)[0]
    assert h[1] != hash_block_chain(root, [0, 2, 3, 4, 5, 6, 7, 8], 4, 2)[1]  # same block, other parent
    assert hash_block_chain(root_hash("qwen3", "v2"), toks, 4, 2)[0] != h[0]
    assert len(h[0]) == 16 and H3 not in h
