from __future__ import annotations

import pytest

from fastdeploy_r3.blobstore.health import StoreHealth
from fastdeploy_r3.cache_manager.block_hash import root_hash
from fastdeploy_r3.cache_manager.prefix_cache_manager import PrefixCacheManager
from fastdeploy_r3.cache_manager.storage_lookup import StorageLookup
from fastdeploy_r3.cache_manager.storage_tier import StorageTier
from fastdeploy_r3.cache_manager.transfer import TransferAck, TransferKind, TransferTask
from fastdeploy_r3.cache_manager.transfer_supervisor import TransferSupervisor
from fastdeploy_r3.engine.request import Request, RequestStatus
from fastdeploy_r3.engine.scheduler import Scheduler
from fastdeploy_r3.sampling_params import SamplingParams


def make(num_blocks: int, budget: int = 64, max_seqs: int = 8, caching: bool = True) -> Scheduler:
    kv = PrefixCacheManager(num_blocks, block_size=4, enable_prefix_caching=caching, root_hash=root_hash("t", "0"))
    return Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=True)


def req(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))


def step(s: Scheduler, sampled: int = 99) -> list[tuple[str, int, bool]]:
    """One engine step without a model: every chunk that reaches the last token samples `sampled`."""
    out = s.schedule()
    got = [(c.request.request_id, c.num_new_tokens, c.samples) for c in out.chunks]
    s.update_after_step(out)
    for c in out.chunks:
        if c.samples:
            c.request.output_token_ids.append(sampled)
    s.kv.check_integrity()
    return got


def test_prefix_hit_leaves_the_last_prompt_token_to_compute():
    """Two 8-token prompts, identical: the second reuses block 0 only, so its last token is computed."""
    s = make(8)
    a = req("a", list(range(8)))
    s.add_request(a)
    assert step(s) == [("a", 8, True)]
    assert s.kv.block_table("a") == [0, 1]
    b = req("b", list(range(8)))
    s.add_request(b)
    assert step(s) == [("a", 1, True), ("b", 4, True)]
    assert b.num_cached_tokens == 4
    assert s.kv.block_table("b")[0] == s.kv.block_table("a")[0] == 0
    assert s.kv.block_tags("b")[0] == s.kv.block_tags("a")[0]
    assert s.kv.block_table("a") == [0, 1, 2] and s.kv.block_table("b") == [0, 3]


def test_chunked_prefill_advances_the_cursor_by_the_budget():
    """A 10-token prompt under a 4-token budget: chunks of 4, 4, 2, and only the last one samples."""
    s = make(8, budget=4)
    a = req("a", list(range(10)))
    s.add_request(a)
    assert step(s) == [("a", 4, False)]
    assert a.num_computed_tokens == 4
    assert step(s) == [("a", 4, False)]
    assert step(s) == [("a", 2, True)]
    assert a.output_token_ids == [99] and a.num_computed_tokens == 10
    assert step(s) == [("a", 1, True)]


def test_youngest_request_is_preempted_when_blocks_run_out_and_recomputes():
    """Four blocks, two 7-token prompts (2 blocks each): the first decode past 8 tokens preempts b."""
    s = make(4, caching=False)
    a, b = req("a", list(range(7))), req("b", list(range(100, 107)))
    s.add_request(a)
    s.add_request(b)
    assert step(s) == [("a", 7, True), ("b", 7, True)]
    assert s.kv.block_table("a") == [0, 1] and s.kv.block_table("b") == [2, 3]
    # a now has 8 tokens: feeding its 8th needs no new block; its 9th would
    assert step(s) == [("a", 1, True), ("b", 1, True)]
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("a", 1)]
    assert s.kv.block_table("a") == [0, 1, 3] and s.kv.block_table("b") == []
    assert list(s.waiting) == [b]
    s.update_after_step(out)
    s.kv.check_integrity()
    # once a finishes, b is readmitted and recomputes prompt + its 2 sampled tokens in one chunk
    s.release(a, RequestStatus.FINISHED_LENGTH)
    assert step(s) == [("b", 9, True)]
    assert s.num_preemptions == 1


def test_finished_blocks_stay_cached_and_abort_leaks_nothing():
    """A finishes; its full block is hit by b; an aborted waiting request releases nothing it never had."""
    s = make(6)
    a = req("a", [5, 6, 7, 8, 9])
    s.add_request(a)
    step(s)
    s.release(a, RequestStatus.FINISHED_STOPPED)
    assert s.kv.gpu.num_free_blocks == 6
    c = req("c", [1, 2, 3])
    s.add_request(c)
    s.release(c, RequestStatus.FINISHED_ABORTED)
    b = req("b", [5, 6, 7, 8, 1])
    s.add_request(b)
    assert step(s) == [("b", 1, True)]
    assert b.num_cached_tokens == 4
    s.kv.check_integrity()


def test_forced_hash_collision_is_recomputed_not_served(monkeypatch):
    """Every block hashes alike: 'b' (tokens 100..) finds a's block 0 under its hash but not its tokens,
    so it gets no prefix hit and its own blocks; an exact repeat of 'a' still hits."""
    from fastdeploy_r3.cache_manager import prefix_cache_manager

    monkeypatch.setattr(prefix_cache_manager, "chain_hash", lambda parent, tokens: b"\x00" * 16)
    s = make(8)
    s.add_request(req("a", list(range(8))))
    step(s)
    b = req("b", list(range(100, 108)))
    s.add_request(b)
    assert step(s) == [("a", 1, True), ("b", 8, True)]
    assert b.num_cached_tokens == 0 and s.kv.block_table("b") == [3, 4]
    c = req("c", list(range(8)))
    s.add_request(c)
    step(s)
    assert c.num_cached_tokens == 4 and s.kv.block_table("c")[0] == 0


class StoreThatAcksOnPoll:
    """A storage tier behind a fake CTM: a put lands (and is acknowledged) at the next poll; loads succeed."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self._puts: list[TransferTask] = []
        self._acks: dict[int, TransferAck] = {}

    def exists(self, keys: list[str]) -> list[bool]:
        return [k in self.keys for k in keys]

    def submit(self, task: TransferTask) -> None:
        if task.kind is TransferKind.GPU2STORAGE:
            self._puts.append(task)
        else:
            self._acks[task.task_id] = TransferAck(task.task_id, task.kind, ok=True)

    def poll(self) -> list[TransferAck]:
        acks = []
        for task in self._puts:
            self.keys.update(task.storage_keys)
            acks.append(TransferAck(task.task_id, task.kind, ok=True))
        self._puts.clear()
        return acks

    def wait(self, task_id: int, timeout: float | None = 60) -> TransferAck:
        return self._acks.pop(task_id)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("store_degraded", [False, True])
def test_a_lookup_answered_before_a_put_landed_still_finds_the_stored_blocks(store_degraded: bool):
    """Three GPU blocks, no CPU tier. a, c and b (b has a's prompt) all start their storage lookups at
    once, while the store is empty. a runs and writes its 2 full blocks through; c then evicts them.
    b's lookup said 'not stored' before a's put landed: b still loads both blocks instead of
    recomputing them (before, it recomputed all 9 tokens and its put was refused as a conflict).
    Unless the store has since been marked degraded: then nothing is sent to it and b recomputes."""
    store = StoreThatAcksOnPoll()
    lookup = StorageLookup(store, deadline_s=30.0, health=StoreHealth("kv storage"))
    tier = StorageTier(lookup, TransferSupervisor(None, client=store))
    kv = PrefixCacheManager(3, block_size=4, enable_prefix_caching=True, root_hash=root_hash("t", "0"),
                            connectors=[tier])
    s = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64, enable_chunked_prefill=True)
    a, c, b = req("a", list(range(9)), 1), req("c", list(range(100, 109)), 1), req("b", list(range(9)), 1)
    for r in (a, c, b):
        s.add_request(r)
    assert step(s) == []  # three lookups running
    while kv.has_pending_lookups():
        lookup.wait(0.05)
    assert step(s) == [("a", 9, True)]  # c and b wait for blocks; b's lookup has answered [False, False]
    kv.poll_transfers()
    assert len(store.keys) == 2
    s.release(a, RequestStatus.FINISHED_LENGTH)
    assert step(s) == [("c", 9, True)]  # evicts a's cached blocks
    kv.poll_transfers()
    s.release(c, RequestStatus.FINISHED_LENGTH)
    if store_degraded:
        lookup.health.failed("ConnectionError: refused")
        assert step(s) == [("b", 9, True)]
        assert b.num_cached_tokens == 0 and kv.counters.storage_load_blocks == 0
    else:
        assert step(s) == [("b", 1, True)]
        assert b.num_cached_tokens == 8 and kv.counters.storage_load_blocks == 2
    lookup.close()


def test_lookahead_slots_stop_at_max_model_len():
    """3 lookahead slots (k = 3 drafts), blocks of 4, max_model_len 12: a 6-token prompt reserves all 3
    (9 slots, 3 blocks); a 10-token prompt only 1 (its drafts end at position 10 = max_model_len - 2), so
    11 slots, 3 blocks, not the 4 that 13 slots would take."""
    kv = PrefixCacheManager(8, block_size=4, enable_prefix_caching=False, root_hash=root_hash("t", "0"))
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True,
                  num_lookahead_tokens=3, max_model_len=12)  # fmt: skip
    s.add_request(req("short", list(range(6))))
    s.add_request(req("long", list(range(10)), max_tokens=2))
    assert step(s) == [("short", 6, True), ("long", 10, True)]
    assert len(kv.block_table("short")) == 3 and len(kv.block_table("long")) == 3
    assert s._lookahead(s.running[1], 11) == 0  # at 11 tokens nothing more is ever fed
