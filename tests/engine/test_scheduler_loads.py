"""Storage-tier loads that run while the engine steps, without processes: a fake cache transfer manager
holds every load until the test acks it (puts land at the next poll), so each story asserts the exact
blocks a LOADING request holds, when they are freed and the tags their rows carry.

Blocks of 4 tokens. The store holds the chain of PROMPT's first two full blocks (tokens 0..7), as if
another engine had written them; a request for PROMPT hits both in storage (its last token, 8, is
always computed)."""

from __future__ import annotations

import pytest

from fastdeploy_r3.blobstore.health import StoreHealth
from fastdeploy_r3.cache_manager.block_hash import block_hash, hash_block_chain, root_hash
from fastdeploy_r3.cache_manager.kv_connector import BlockKey
from fastdeploy_r3.cache_manager.prefix_cache_manager import PrefixCacheManager
from fastdeploy_r3.cache_manager.storage_lookup import StorageLookup
from fastdeploy_r3.cache_manager.storage_tier import StorageTier
from fastdeploy_r3.cache_manager.transfer import (
    CacheTransferError,
    CacheTransferTimeout,
    RemoteBlocks,
    TransferAck,
    TransferKind,
    TransferTask,
)
from fastdeploy_r3.cache_manager.transfer_supervisor import TransferSupervisor
from fastdeploy_r3.engine.overlap import schedule_ahead
from fastdeploy_r3.engine.request import Request, RequestStatus
from fastdeploy_r3.engine.scheduler import Scheduler
from fastdeploy_r3.sampling_params import SamplingParams

ROOT = root_hash("t", "0")
PROMPT = list(range(9))


class HeldCTM:
    """A CTM whose loads wait for ack(task_id); puts are stored and acknowledged at the next poll."""

    pid = 4242

    def __init__(self) -> None:
        self.keys = {h.hex() for h in hash_block_chain(ROOT, PROMPT, 4, 2)}
        self.loads: list[TransferTask] = []
        self._puts: list[TransferTask] = []
        self._acks: dict[int, TransferAck] = {}
        self.alive = True
        self.waits: list[float] = []

    # the lookup's store
    def exists(self, keys: list[str]) -> list[bool]:
        return [k in self.keys for k in keys]

    def close(self) -> None:
        pass

    # the transfer client
    def submit(self, task: TransferTask) -> None:
        if not self.alive:
            raise CacheTransferError("cache transfer manager (pid 4242) exited with code -9")
        (self._puts if task.kind is TransferKind.GPU2STORAGE else self.loads).append(task)

    def ack(self, task: TransferTask, failed: tuple[int, ...] = ()) -> None:
        self._acks[task.task_id] = TransferAck(task.task_id, task.kind, ok=not failed, failed=list(failed))

    def poll(self) -> list[TransferAck]:
        if not self.alive:
            raise CacheTransferError("cache transfer manager (pid 4242) exited with code -9")
        for task in self._puts:
            self.keys.update(task.storage_keys)
            self._acks[task.task_id] = TransferAck(task.task_id, task.kind, ok=True)
        self._puts.clear()
        acks, self._acks = list(self._acks.values()), {}
        return acks

    def wait(self, task_id: int, timeout: float | None = 60) -> TransferAck:
        if task_id not in self._acks:
            raise CacheTransferTimeout(f"no ack for task {task_id} within {timeout} s")
        return self._acks.pop(task_id)

    def wait_any(self, timeout: float) -> bool:
        self.waits.append(timeout)
        return bool(self._acks)

    def is_alive(self) -> bool:
        return self.alive

    def kill(self) -> None:
        self.alive = False

    def shutdown(self, timeout: float = 5.0) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks: int = 8, max_seqs: int = 4) -> tuple[Scheduler, HeldCTM, Clock]:
    ctm, clock = HeldCTM(), Clock()
    transfers = TransferSupervisor(None, timeout_s=30.0, client=ctm)
    lookup = StorageLookup(ctm, deadline_s=30.0, health=StoreHealth("kv storage"))
    kv = PrefixCacheManager(num_blocks, block_size=4, enable_prefix_caching=True, root_hash=ROOT,
                            connectors=[StorageTier(lookup, transfers, clock=clock)])
    s = Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=64, enable_chunked_prefill=True,
                  nonblocking_loads=True)
    return s, ctm, clock


def req(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))


def step(s: Scheduler, sampled: int = 99) -> list[tuple[str, int]]:
    """One engine step without a model (the loop polls the transfers first, as the engine does), once
    every storage lookup answered."""
    while s.kv.has_pending_lookups():
        s.kv.connectors[0].lookups.wait(0.05)
    s.kv.poll_transfers()
    out = s.schedule()
    s.update_after_step(out)
    for c in out.chunks:
        if c.samples:
            c.request.output_token_ids.append(sampled)
    s.kv.check_integrity()
    return [(c.request.request_id, c.num_new_tokens) for c in out.chunks]


def loading(s: Scheduler, ctm: HeldCTM, rid: str = "b") -> tuple[Request, TransferTask]:
    """a decodes (running, blocks 0..2 after its prompt); b (PROMPT) is admitted LOADING into 3, 4, 5."""
    a = req("a", list(range(100, 109)), max_tokens=20)
    s.add_request(a)
    while not step(s):
        pass
    b = req(rid, PROMPT)
    s.add_request(b)
    while b.status is RequestStatus.WAITING:
        assert step(s) == [("a", 1)]
    assert b.status is RequestStatus.LOADING and s.loading == [b]
    (task,) = ctm.loads
    assert task.kind is TransferKind.STORAGE2GPU and task.gpu_block_ids == [3, 4]
    assert s.kv.block_table(rid) == [3, 4, 5] and s.kv.is_loading(rid)
    return b, task


def test_a_running_request_keeps_decoding_while_another_loads_then_it_joins_at_the_loaded_cursor():
    s, ctm, _ = make()
    b, task = loading(s, ctm)
    for _ in range(3):  # the load is in flight: a decodes, b holds 3 blocks and is not scheduled
        assert step(s) == [("a", 1)]
    assert s.kv.block_tags("b") == [0, 0, 0]  # no block of b is data yet
    assert s.kv.gpu.cached_block(bytes.fromhex(task.storage_keys[0])) is None
    ctm.ack(task)
    assert step(s) == [("a", 1), ("b", 1)]  # b computes only its last prompt token
    assert (b.status, b.num_cached_tokens, b.num_computed_tokens) == (RequestStatus.RUNNING, 8, 9)
    assert s.kv.block_tags("b")[:2] == task.routing_tags  # the rows the CTM stamped
    assert s.kv.gpu.cached_block(bytes.fromhex(task.storage_keys[1])).block_id == 4
    assert s.kv.counters.storage_load_blocks == 2


def test_a_load_failing_half_way_truncates_there_and_the_rest_is_computed_under_fresh_tags():
    s, ctm, _ = make()
    b, task = loading(s, ctm)
    ctm.ack(task, failed=(1,))
    assert step(s) == [("a", 1), ("b", 5)]  # tokens 4..8: block 4 is recomputed
    assert b.num_cached_tokens == 4
    tags = s.kv.block_tags("b")
    assert tags[0] == task.routing_tags[0] and tags[1] not in task.routing_tags
    # block 4 is cached as b computed it in that step, under its fresh tag, not the load's
    assert s.kv.gpu.cached_block(bytes.fromhex(task.storage_keys[1])).routing_tag == tags[1]
    c = s.kv.counters
    assert (c.storage_load_blocks, c.storage_load_failed_blocks) == (1, 1)


def test_abort_while_loading_frees_the_blocks_only_once_the_load_answered():
    s, ctm, _ = make()
    b, task = loading(s, ctm)
    free = s.kv.gpu.num_free_blocks
    s.release(b, RequestStatus.FINISHED_ABORTED)
    assert s.loading == [] and s.kv.block_table("b") == []
    assert [s.kv.gpu.blocks[i].ref_cnt for i in (3, 4, 5)] == [1, 1, 1]  # the CTM may still write 3, 4
    assert s.kv.gpu.num_free_blocks == free and s.kv.has_loads_in_flight()
    s.kv.check_integrity()
    c = req("c", list(range(200, 215)))  # needs 4 blocks: only 2 are free, none of b's is handed out
    s.add_request(c)
    assert step(s) == [("a", 1)]
    ctm.ack(task)
    assert step(s) == [("a", 1), ("c", 15)]
    assert not s.kv.has_loads_in_flight()
    assert s.kv.gpu.cached_block(bytes.fromhex(task.storage_keys[0])) is None  # nobody's: not cached
    for r in (s.running[0], c):
        s.release(r, RequestStatus.FINISHED_ABORTED)
    s.kv.poll_transfers()  # c's write-through lands
    s.kv.check_integrity()
    assert s.kv.gpu.num_free_blocks == 8


@pytest.mark.parametrize("fault", ["dies", "stuck"])
def test_a_lost_ctm_ends_the_load_as_a_recompute_once_it_can_write_no_more(fault: str):
    """dies: the next tick finds it gone. stuck: no ack within timeout_s marks it lost, but it may still
    write, so b keeps its blocks until the tick has killed it; then b recomputes all 9 tokens."""
    s, ctm, clock = make()
    b, task = loading(s, ctm)
    transfers = s.kv.connectors[0].transfers
    if fault == "dies":
        ctm.alive = False
    else:
        clock.now = 31.0
        assert step(s) == [("a", 1)]
        assert transfers.lost is not None and ctm.alive and b.status is RequestStatus.LOADING
    transfers.tick()  # kills it; without a config nothing replaces it
    assert not ctm.alive and transfers.failed is not None
    assert step(s) == [("a", 1), ("b", 9)]
    assert b.num_cached_tokens == 0 and not set(s.kv.block_tags("b")) & set(task.routing_tags)
    assert s.kv.counters.storage_load_failed_blocks == 2


def test_an_idle_loop_waits_on_the_ack_and_the_step_after_a_load_is_not_planned_ahead():
    s, ctm, _ = make()
    b, task = loading(s, ctm)
    s.kv.wait_for_loads(0.01)
    assert ctm.waits == [0.01]  # on the client's pipe, not in a sleep
    out = s.schedule()
    assert schedule_ahead(s, out.chunks, 100) is not None  # the load runs: decodes are planned ahead
    ctm.ack(task)
    assert schedule_ahead(s, out.chunks, 100) is None  # b joined: its first chunk is scheduled in sync
    assert b.status is RequestStatus.RUNNING and s.running[-1] is b


def test_new_weights_while_loading_send_the_request_back_to_recompute():
    s, ctm, _ = make()
    b, task = loading(s, ctm)
    s.kv.reset_root(root_hash("t", "1"))
    ctm.ack(task)
    assert step(s) == [("a", 1)]  # b was requeued (its lookup under the new root runs)
    assert b.status is RequestStatus.WAITING and s.kv.block_table("b") == []
    assert s.kv.gpu.cached_block(bytes.fromhex(task.storage_keys[0])) is None
    while b.status is RequestStatus.WAITING:
        step(s)
    assert b.num_computed_tokens == 9 and b.num_cached_tokens == 0


def test_retract_takes_loading_requests_back_and_their_blocks_wait_for_the_load():
    s, ctm, _ = make()
    b, task = loading(s, ctm)
    assert s.retract_running() == 2
    assert [r.request_id for r in s.waiting] == ["a", "b"] and s.loading == []
    assert [s.kv.gpu.blocks[i].ref_cnt for i in (3, 4, 5)] == [1, 1, 1]
    s.kv.check_integrity()
    ctm.ack(task)
    s.kv.poll_transfers(block=True)  # what an idle engine's integrity check does
    assert s.kv.gpu.num_free_blocks == 8
    s.kv.check_integrity()


def test_waiting_for_a_load_that_never_answers_kills_the_ctm_before_the_blocks_go_back():
    """An idle engine's integrity check (poll_transfers(block=True)) with a load of a stuck CTM: the
    wait times out, the CTM is killed, and only then are the abandoned blocks freed."""
    s, ctm, _ = make()
    b, task = loading(s, ctm)
    s.release(s.running[0], RequestStatus.FINISHED_ABORTED)
    s.release(b, RequestStatus.FINISHED_ABORTED)
    s.kv.poll_transfers(block=True)
    assert not ctm.alive and s.kv.gpu.num_free_blocks == 8 and not s.kv.has_loads_in_flight()
    s.kv.check_integrity()


def test_a_request_whose_prefix_another_is_loading_waits_for_it_instead_of_loading_it_twice():
    """b2 has b's prompt (as n > 1 samples do): while b loads blocks 3, 4, b2 keeps its place in the
    queue; once they are in, b2 hits them in the GPU pool (one load, no second copy of the prefix)."""
    s, ctm, _ = make()
    b, task = loading(s, ctm)
    b2 = req("b2", PROMPT)
    s.add_request(b2)
    for _ in range(2):
        assert step(s) == [("a", 1)]
    assert b2.status is RequestStatus.WAITING and len(ctm.loads) == 1
    ctm.ack(task)
    assert step(s) == [("a", 1), ("b", 1), ("b2", 1)]
    assert s.kv.block_table("b2")[:2] == [3, 4] and b2.num_cached_tokens == 8
    assert s.kv.counters.gpu_hit_blocks == 2 and s.kv.counters.storage_load_blocks == 2


def test_a_prefill_servers_room_loads_as_pd2gpu_from_the_first_block_the_gpu_pool_lacks():
    """PD: the store holds none of ROOM_PROMPT's blocks, but a prefill server's room does (expect_remote):
    both full blocks are found, the load is one PD2GPU task naming the room from block 0, and the request
    joins at the loaded cursor. A second request of the same first block finds it in the GPU pool and
    asks the room for block 1 only. A freed request's room is forgotten."""
    s, ctm, _ = make()
    room_prompt = list(range(50, 59))
    room = RemoteBlocks("127.0.0.1", 8998, 31, 4096, (11, 12))
    assert s.kv.expect_remote("r", room)
    r = req("r", room_prompt)
    s.add_request(r)
    while r.status is RequestStatus.WAITING:
        step(s)
    (task,) = ctm.loads
    assert (task.kind, task.gpu_block_ids, task.remote, task.first_block) == (TransferKind.PD2GPU, [0, 1], room, 0)
    assert task.storage_keys == [] and len(task.routing_tags) == 2
    ctm.ack(task)
    assert step(s) == [("r", 1)]  # only the last prompt token is computed
    assert (r.num_cached_tokens, s.kv.block_tags("r")[:2]) == (8, task.routing_tags)

    other = room_prompt[:4] + [70, 71, 72, 73, 74]
    assert s.kv.expect_remote("r2", RemoteBlocks("127.0.0.1", 8998, 32, 4096, (21, 22)))
    r2 = req("r2", other)
    s.add_request(r2)
    while r2.status is RequestStatus.WAITING:
        step(s)
    task2 = ctm.loads[-1]
    assert (task2.kind, task2.first_block, len(task2.gpu_block_ids)) == (TransferKind.PD2GPU, 1, 1)
    assert s.kv.block_table("r2")[0] == s.kv.block_table("r")[0]  # block 0: the GPU pool's
    ctm.ack(task2, failed=(0,))  # P's block 1 did not arrive whole: computed here
    step(s)
    assert r2.num_cached_tokens == 4 and len(ctm.loads) == 2

    tier = s.kv.connectors[0]
    keys = [BlockKey(h, ()) for h in hash_block_chain(ROOT, list(range(80, 89)), 4, 2)]
    tier.expect_remote("r3", RemoteBlocks("127.0.0.1", 8998, 33, 4096, (31, 32)))
    assert len(tier.lookup("r3", keys, 0).keys) == 2  # the room answers at once, without the store
    tier.on_free("r3")  # the request released its blocks (finished, aborted, preempted): the room is forgotten
    assert tier.lookup("r3", keys, 0) is None  # the store is asked now (its lookup runs off the loop)


TAIL_PROMPT = list(range(60, 70))  # two full blocks, then a partial one of 2 tokens (60..67 | 68, 69)


def _room(room: int, digests: tuple[int, ...], tail_tokens: int = 2) -> RemoteBlocks:
    return RemoteBlocks("127.0.0.1", 8998, room, 4096, digests, tail_tokens=tail_tokens)


def _admit_loading(s: Scheduler, r: Request) -> None:
    s.kv.expect_prompt_tail(r.request_id, len(TAIL_PROMPT))  # P's prompt: what the decode server passes on
    s.add_request(r)
    while r.status is RequestStatus.WAITING:
        step(s)
    assert r.status is RequestStatus.LOADING


def test_a_rooms_partial_last_block_loads_with_its_full_ones_and_only_ps_token_is_computed():
    """D's request is P's 10-token prompt plus P's first token (99). The room holds two full blocks and the
    partial last one (2 tokens): one PD2GPU task writes all three, the request joins at token 10 and
    computes P's token alone, its tail block keeps the tag its rows landed under. A second request of
    the same prompt finds both full blocks in the GPU pool and asks the room for the partial block only;
    it did not arrive whole there, so that request computes its 2 tokens itself."""
    s, ctm, _ = make()
    assert s.kv.expect_remote("r", _room(41, (11, 12, 13)))
    r = req("r", TAIL_PROMPT + [99])
    _admit_loading(s, r)
    (task,) = ctm.loads
    assert (task.kind, task.gpu_block_ids, task.first_block) == (TransferKind.PD2GPU, [0, 1, 2], 0)
    assert s.kv.block_table("r") == [0, 1, 2]  # 11 tokens: the partial block takes P's token as well
    ctm.ack(task)
    assert step(s) == [("r", 1)]
    assert (r.num_cached_tokens, s.kv.block_tags("r")) == (10, task.routing_tags)

    assert s.kv.expect_remote("r2", _room(42, (21, 22, 23)))
    r2 = req("r2", TAIL_PROMPT + [98])
    _admit_loading(s, r2)
    task2 = ctm.loads[-1]
    assert (task2.first_block, len(task2.gpu_block_ids)) == (2, 1)
    assert s.kv.block_table("r2")[:2] == s.kv.block_table("r")[:2]
    ctm.ack(task2, failed=(0,))
    assert ("r2", 3) in step(s)  # the 2 tokens of the partial block, then P's token (r decodes beside it)
    assert r2.num_cached_tokens == 8 and s.kv.block_tags("r2")[2] != task2.routing_tags[0]


def test_a_partial_block_that_would_leave_nothing_to_compute_is_not_loaded():
    """P's token ended the request: D runs the prompt alone (its last token's logits are the step's), so
    the room's partial block is not asked for, only the full ones."""
    s, ctm, _ = make()
    assert s.kv.expect_remote("r", _room(43, (11, 12, 13)))
    r = req("r", TAIL_PROMPT, max_tokens=1)
    _admit_loading(s, r)
    (task,) = ctm.loads
    assert (task.gpu_block_ids, task.first_block) == ([0, 1], 0)
    ctm.ack(task)
    assert step(s) == [("r", 2)]


def test_a_prefill_request_stores_its_partial_last_block_as_it_ends_and_pins_it_until_stored():
    """P: a request with keep_prompt_tail computes its prompt and samples; as it ends, its partial last
    block (GPU block 2, tokens 68 and 69) is stored under the chain hash of those two tokens, from the
    hash of the full blocks before it, with tail_tokens=2; the block stays held until the put answered.
    A request that did not compute its prompt (aborted while waiting) stores nothing."""
    s, ctm, _ = make()
    s.kv.keep_prompt_tail("p", len(TAIL_PROMPT))
    p = req("p", TAIL_PROMPT, max_tokens=1)
    s.add_request(p)
    while not p.output_token_ids:
        step(s)
    assert ctm._puts and all(t.tail_tokens == 0 for t in ctm._puts)  # the full blocks, written through
    s.release(p, RequestStatus.FINISHED_LENGTH)
    (put,) = [t for t in ctm._puts if t.tail_tokens]
    full = hash_block_chain(ROOT, TAIL_PROMPT, 4, 2)
    assert (put.kind, put.gpu_block_ids, put.tail_tokens) == (TransferKind.GPU2STORAGE, [2], 2)
    assert put.storage_keys == [block_hash(full[-1], [68, 69]).hex()]
    assert s.kv.gpu.blocks[2].ref_cnt == 1  # pinned: the CTM reads it after the request let go
    s.kv.check_integrity()
    step(s)  # the put answers
    assert s.kv.gpu.blocks[2].ref_cnt == 0 and not s.kv.saves_in_flight()

    s.kv.keep_prompt_tail("q", len(TAIL_PROMPT))
    q = req("q", TAIL_PROMPT[:9] + [5], max_tokens=1)
    s.add_request(q)
    s.release(q, RequestStatus.FINISHED_ABORTED)
    assert not ctm._puts and not s.kv.saves_in_flight()


def test_a_preempted_prefill_request_still_stores_its_partial_block_when_it_ends():
    """Preemption frees a request's blocks but not what it asked for at its end: P's request, retracted
    after its prompt step, computes again (its full blocks now GPU hits) and stores its partial block as
    it is released."""
    s, ctm, _ = make()
    s.kv.keep_prompt_tail("p", len(TAIL_PROMPT))
    p = req("p", TAIL_PROMPT, max_tokens=1)
    s.add_request(p)
    while not p.output_token_ids:  # its storage lookup answers first (a miss)
        step(s)
    assert s.retract_running() == 1 and not [t for t in ctm._puts if t.tail_tokens]
    assert step(s) == [("p", 3)]  # tokens 68, 69 and the one it sampled: blocks 0 and 1 were GPU hits
    s.release(p, RequestStatus.FINISHED_LENGTH)
    (put,) = [t for t in ctm._puts if t.tail_tokens]
    assert put.storage_keys == [block_hash(hash_block_chain(ROOT, TAIL_PROMPT, 4, 2)[-1], [68, 69]).hex()]


def test_through_a_shared_store_the_partial_block_is_found_under_its_key_and_loads_with_the_full_ones():
    """The store backend: P stored TAIL_PROMPT's two full blocks and its partial last one (under the chain
    hash of tokens 68, 69) in the store both servers share. D's request finds all three in one lookup and
    loads them in one STORAGE2GPU task; a request that does not continue P's prompt never asks for the
    partial key, and a room without a partial block is not asked for one."""
    s, ctm, _ = make()
    full = hash_block_chain(ROOT, TAIL_PROMPT, 4, 2)
    tail = block_hash(full[-1], [68, 69]).hex()
    ctm.keys = {h.hex() for h in full} | {tail}
    r = req("r", TAIL_PROMPT + [99])
    _admit_loading(s, r)
    (task,) = ctm.loads
    assert (task.kind, task.storage_keys) == (TransferKind.STORAGE2GPU, [h.hex() for h in full] + [tail])
    ctm.ack(task)
    assert step(s) == [("r", 1)] and r.num_cached_tokens == 10

    plain = req("plain", TAIL_PROMPT + [98])  # the same tokens, but no prefill server's: its full blocks only
    s.add_request(plain)
    step(s)
    assert plain.num_cached_tokens == 8 and len(ctm.loads) == 1  # both full blocks were GPU hits

    assert s.kv.expect_remote("r2", _room(44, (11, 12), tail_tokens=0))
    r2 = req("r2", list(range(80, 90)) + [97])
    s.kv.expect_prompt_tail("r2", 10)
    s.add_request(r2)
    while r2.status is RequestStatus.WAITING:
        step(s)
    assert ctm.loads[-1].gpu_block_ids == s.kv.block_table("r2")[:2]  # P sent no partial block: 2 of 3
