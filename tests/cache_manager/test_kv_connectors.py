"""The prefix cache over its KV connectors, without processes: a fake cache transfer manager acks
every task at once and records it, so each scenario asserts the exact blocks that move and the tag
their rows carry afterwards."""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy_r3.blobstore.health import StoreHealth
from fastdeploy_r3.cache_manager.block_hash import root_hash
from fastdeploy_r3.cache_manager.cpu_tier import CpuTier
from fastdeploy_r3.cache_manager.prefix_cache_manager import PrefixCacheManager
from fastdeploy_r3.cache_manager.storage_lookup import StorageLookup
from fastdeploy_r3.cache_manager.storage_tier import StorageTier
from fastdeploy_r3.cache_manager.transfer import CacheTransferError, TransferAck, TransferTask
from fastdeploy_r3.cache_manager.transfer_supervisor import TransferSupervisor


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class FakeCTM:
    """Acks every task when it is submitted (puts: at the next poll); after die(), it is gone."""

    pid = 4242

    def __init__(self) -> None:
        self.tasks: list[TransferTask] = []
        self._acks: dict[int, TransferAck] = {}
        self.alive = True

    def submit(self, task: TransferTask) -> None:
        if not self.alive:
            raise CacheTransferError("cache transfer manager (pid 4242) exited with code -9")
        self.tasks.append(task)
        self._acks[task.task_id] = TransferAck(task.task_id, task.kind, ok=True)

    def poll(self) -> list[TransferAck]:
        acks, self._acks = list(self._acks.values()), {}
        return acks

    def wait(self, task_id: int, timeout: float | None = 60) -> TransferAck:
        return self._acks.pop(task_id)

    def is_alive(self) -> bool:
        return self.alive

    def kill(self) -> None:
        self.alive = False

    def moves(self) -> list[tuple[str, list[int], list[int]]]:
        return [(t.kind.value, t.gpu_block_ids, t.cpu_block_ids) for t in self.tasks]


class KeySet:
    """The engine's lookup-only store: which keys exist."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.closed = False

    def exists(self, keys: list[str]) -> list[bool]:
        return [k in self.keys for k in keys]

    def close(self) -> None:
        self.closed = True


def compute(kv: PrefixCacheManager, req: Req) -> list[int]:
    """Admit a request, 'run' its whole prompt, cache its full blocks; its block table."""
    hit = kv.find_cached_prefix(req)
    assert hit is not None
    req.num_computed_tokens = kv.admit(req, hit, req.num_tokens - hit.num_blocks * kv.block_size)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    kv.check_integrity()
    return kv.block_table(req.request_id)


def test_evicted_blocks_go_to_the_cpu_tier_and_come_back_with_their_tags():
    """Three GPU blocks of 4 tokens, a 4-block CPU tier. a's two full blocks are evicted by b and swapped
    out (GPU 1 -> CPU 0, GPU 0 -> CPU 1, LRU order); c has a's prompt: its allocation evicts b's two
    full blocks to the CPU tier too (GPU 1, 2 -> CPU 2, 3), then a's come back into GPU 0, 1 and their
    rows carry the tags a's rows were computed under."""
    ctm = FakeCTM()
    transfers = TransferSupervisor(None, client=ctm)
    kv = PrefixCacheManager(3, block_size=4, enable_prefix_caching=True, root_hash=root_hash("t", "0"),
                            connectors=[CpuTier(4, transfers)])
    a = Req("a", list(range(9)))
    assert compute(kv, a) == [0, 1, 2]
    a_tags = kv.block_tags("a")
    kv.free(a)
    b = Req("b", list(range(100, 109)))
    assert compute(kv, b) == [2, 1, 0]
    assert ctm.moves() == [("swap2cpu", [1, 0], [0, 1])]
    kv.free(b)
    c = Req("c", list(range(9)))
    hit = kv.find_cached_prefix(c)
    assert hit is not None and [len(t.keys) for t in hit.tiers] == [2]
    assert kv.admit(c, hit, 1) == 8
    assert kv.block_table("c") == [0, 1, 2]
    assert ctm.moves()[1:] == [("swap2cpu", [1, 2], [2, 3]), ("swap2gpu", [0, 1], [1, 0])]
    assert kv.block_tags("c")[:2] == a_tags[:2]
    assert kv.block_tags("c")[2] not in a_tags
    c_ = kv.counters
    assert (c_.evicted_blocks, c_.swap_out_blocks, c_.swap_in_blocks, c_.dropped_blocks) == (4, 4, 2, 0)
    kv.check_integrity()


def test_a_lost_ctm_unpins_the_write_through_and_the_tiers_step_aside():
    """Storage tier only. a's two full blocks are written through and stay pinned until the put is
    acknowledged; the CTM dies first: the next tick marks it lost and, with no way to start another,
    the engine serves from the GPU pool alone; the blocks are unpinned at the next poll, b's lookup
    finds nothing, and closing the manager closes the lookup's store."""
    ctm, store = FakeCTM(), KeySet()
    transfers = TransferSupervisor(None, client=ctm)
    lookup = StorageLookup(store, deadline_s=30.0, health=StoreHealth("kv storage"))
    kv = PrefixCacheManager(3, block_size=4, enable_prefix_caching=True, root_hash=root_hash("t", "0"),
                            connectors=[StorageTier(lookup, transfers)])
    a = Req("a", list(range(9)))
    while kv.find_cached_prefix(a) is None:  # the store's answer comes from the lookup thread
        lookup.wait(0.05)
    compute(kv, a)
    assert ctm.moves() == [("gpu2storage", [0, 1], [])]
    kv.free(a)
    assert kv.gpu.num_free_blocks == 1  # blocks 0 and 1 are pinned by the put
    ctm.alive = False
    transfers.tick()
    assert transfers.lost is None and transfers.failed == "no config to start another one with"
    assert transfers.transfers_lost == 1 and transfers.replacements == 1
    kv.poll_transfers()
    assert kv.gpu.num_free_blocks == 3
    store.keys.update(t.storage_keys[0] for t in ctm.tasks)  # even a block that is there is not loaded
    b = Req("b", list(range(9)))
    hit = kv.find_cached_prefix(b)
    assert hit is not None and hit.num_blocks == 2 and hit.tiers == []  # a's blocks, still on the GPU
    kv.check_integrity()
    kv.close()
    assert store.closed


def test_the_engine_side_of_the_cache_names_ctm_errors_without_the_subprocess_module_or_torch():
    """The manager, its tiers and the CTM's supervisor and client import only the boundary module
    (transfer.py) of the CTM: neither the subprocess module nor torch is loaded by them."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    code = (
        "import sys\n"
        "from fastdeploy_r3.cache_manager import cpu_tier, prefix_cache_manager, storage_tier, transfer_supervisor\n"
        "from fastdeploy_r3.cache_manager.transfer import CacheTransferError, CacheTransferTimeout\n"
        "banned = ('torch', 'fastdeploy_r3.cache_manager.cache_transfer_manager')\n"
        "print(sorted(m for m in banned if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
