"""Scenarios for the CacheTransferManager subprocess: KV and R3 rows move together, bit for bit.

Tiny engine: TP=2, 2 layers, 6 "GPU" blocks of 4 tokens, 4 CPU blocks; R3 with L=2, K=2 (uint8).
The "GPU" tier is shared memory created here, as the engine and workers would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from fastdeploy_r3.blobstore import open_blob_store
from fastdeploy_r3.cache_manager.cache_transfer_client import CacheTransferClient, CacheTransferError
from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer, RoutingBufferSpec
from fastdeploy_r3.cache_manager.shm import ShmSegment, list_segments, new_engine_suffix, shm_name, unlink_all
from fastdeploy_r3.cache_manager.slots import block_slots
from fastdeploy_r3.cache_manager.transfer import CacheTransferConfig, KVCacheSpec, TransferKind, TransferTask

TP, LAYERS, GPU_BLOCKS, CPU_BLOCKS, BS, HEADS, HEAD_DIM = 2, 2, 6, 4, 4, 2, 4
L, K = 2, 2
NAMESPACE = "fake-small@weights-v1"


@dataclass
class Engine:
    suffix: str
    kv: list[torch.Tensor]  # per rank [LAYERS, 2, GPU_BLOCKS, BS, HEADS, HEAD_DIM]
    host: RoutingBuffer  # routing_host_buffer [GPU_BLOCKS * BS, L, K]
    client: CacheTransferClient
    storage_url: str | None
    _segments: list[ShmSegment]
    _next_task: int = 0

    def run(self, kind: TransferKind, gpu: list[int], **kw) -> object:
        self._next_task += 1
        self.client.submit(TransferTask(self._next_task, kind, gpu, **kw))
        return self.client.wait(self._next_task, timeout=20)

    def fill(self, block_id: int, tag: int, seed: int) -> None:
        """What a forward pass would leave: random KV on every rank, random rows tagged `tag`."""
        g = torch.Generator().manual_seed(seed)
        for kv in self.kv:
            kv[:, :, block_id] = torch.randn(kv[:, :, block_id].shape, generator=g).to(kv.dtype)
        slots = block_slots([block_id], BS)
        rows = np.random.default_rng(seed).integers(0, 128, size=(BS, L, K), dtype=np.uint8)
        self.host.write(rows, slots, np.full(BS, tag, dtype=np.int64))

    def clear(self, block_id: int) -> None:
        """The block is freed and reused: KV zeroed, rows back to the sentinel, tags to 0."""
        for kv in self.kv:
            kv[:, :, block_id] = 0
        slots = block_slots([block_id], BS)
        self.host.write(np.full((BS, L, K), self.host.sentinel, np.uint8), slots, np.zeros(BS, np.int64))

    def snapshot(self, block_id: int) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        slots = block_slots([block_id], BS)
        rows, tags = self.host.read(slots)
        return [kv[:, :, block_id].contiguous().view(torch.uint8).numpy().tobytes() for kv in self.kv], rows, tags


def _start_engine(storage_url: str | None, dtype: torch.dtype = torch.float32) -> Engine:
    suffix = new_engine_suffix()
    shape = (LAYERS, 2, GPU_BLOCKS, BS, HEADS, HEAD_DIM)
    itemsize = torch.empty((), dtype=dtype).element_size()
    segments, kv, specs = [], [], []
    for rank in range(TP):
        name = shm_name(suffix, f"kv_gpu_rank{rank}")
        seg = ShmSegment.create(name, int(np.prod(shape)) * itemsize)
        segments.append(seg)
        kv.append(seg.torch(shape, dtype))
        kv[-1].zero_()
        specs.append(KVCacheSpec(name, shape, str(dtype).removeprefix("torch.")))
    host_spec = RoutingBufferSpec(shm_name(suffix, "routing_host"), GPU_BLOCKS * BS, L, K, "uint8")
    host = RoutingBuffer.create(host_spec)
    config = CacheTransferConfig(
        kv_specs=specs,
        num_cpu_blocks=CPU_BLOCKS,
        block_size=BS,
        routing_host=host_spec,
        routing_swap_name=shm_name(suffix, "routing_swap"),
        kv_cpu_name=shm_name(suffix, "kv_cpu"),
        storage_url=storage_url,
        storage_namespace=NAMESPACE,
        parent_pid=os.getpid(),
    )
    client = CacheTransferClient()
    client.start(config)
    return Engine(suffix, kv, host, client, storage_url, segments)


def _stop_engine(e: Engine) -> None:
    e.client.shutdown()
    del e.kv
    e.host.close()
    for seg in e._segments:
        seg.close()
    assert list_segments(e.suffix) == []


@pytest.fixture(params=["file", "redis"])
def storage_url(request, tmp_path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}"
    return request.getfixturevalue("redis_url")


@pytest.fixture
def engine(storage_url: str) -> Iterator[Engine]:
    e = _start_engine(storage_url)
    yield e
    _stop_engine(e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_out_then_in_to_other_gpu_blocks_restores_kv_and_routing(dtype: torch.dtype) -> None:
    """GPU blocks 1,2 -> CPU blocks 3,0 -> GPU blocks 4,5: KV, rows and tags come back bit for bit."""
    e = _start_engine(None, dtype)
    try:
        e.fill(1, tag=11, seed=1)
        e.fill(2, tag=12, seed=2)
        before = {b: e.snapshot(b) for b in (1, 2)}
        untouched = e.snapshot(0)
        ack = e.run(TransferKind.SWAP2CPU, [1, 2], cpu_block_ids=[3, 0])
        assert ack.ok and ack.failed == [] and ack.nbytes > 0
        e.clear(1)
        e.clear(2)
        ack = e.run(TransferKind.SWAP2GPU, [4, 5], cpu_block_ids=[3, 0])
        assert ack.ok
        for src, dst in ((1, 4), (2, 5)):
            kv, rows, tags = e.snapshot(dst)
            assert kv == before[src][0]
            np.testing.assert_array_equal(rows, before[src][1])
            np.testing.assert_array_equal(tags, before[src][2])
        assert e.snapshot(0)[0] == untouched[0]
        stats = e.client.stats
        assert (stats.swap_out_blocks, stats.swap_in_blocks) == (2, 2)
        assert stats.bytes_moved == 2 * ack.nbytes
    finally:
        _stop_engine(e)


def test_storage_roundtrip_restores_kv_and_rows_with_new_tags(engine: Engine) -> None:
    """GPU blocks 1,2 -> storage -> GPU blocks 5,3 (another 'engine life'): same KV and rows, fresh tags."""
    keys = ["a1" * 16, "b2" * 16]
    engine.fill(1, tag=11, seed=3)
    engine.fill(2, tag=12, seed=4)
    before = {b: engine.snapshot(b) for b in (1, 2)}
    ack = engine.run(TransferKind.GPU2STORAGE, [1, 2], storage_keys=keys)
    assert ack.ok and ack.nbytes > 0
    engine.clear(1)
    engine.clear(2)
    ack = engine.run(TransferKind.STORAGE2GPU, [5, 3], storage_keys=keys, routing_tags=[21, 22])
    assert ack.ok and ack.failed == []
    for src, dst, tag in ((1, 5, 21), (2, 3, 22)):
        kv, rows, tags = engine.snapshot(dst)
        assert kv == before[src][0]
        np.testing.assert_array_equal(rows, before[src][1])
        assert tags.tolist() == [tag] * BS
    stats = engine.client.stats
    assert (stats.storage_put_blocks, stats.storage_get_blocks, stats.storage_miss_blocks) == (2, 2, 0)


def test_corrupt_and_missing_blocks_are_failed_and_leave_gpu_slots_untouched(engine: Engine) -> None:
    """Keys [good, corrupt, missing] -> GPU blocks [4, 5, 0]: only block 4 is written; failed == [1, 2]."""
    good, corrupt, missing = "01" * 16, "02" * 16, "03" * 16
    engine.fill(1, tag=11, seed=5)
    engine.fill(2, tag=12, seed=6)
    assert engine.run(TransferKind.GPU2STORAGE, [1, 2], storage_keys=[good, corrupt]).ok
    _flip_stored_byte(engine.storage_url, corrupt)
    engine.fill(5, tag=55, seed=7)  # whatever was in the target slots before must survive
    engine.fill(0, tag=50, seed=8)
    before = {b: engine.snapshot(b) for b in (1, 5, 0)}
    ack = engine.run(TransferKind.STORAGE2GPU, [4, 5, 0], storage_keys=[good, corrupt, missing], routing_tags=[7, 8, 9])
    assert not ack.ok and ack.failed == [1, 2]
    assert "checksum" in ack.error and "miss" in ack.error
    assert engine.snapshot(4)[0] == before[1][0]
    for b in (5, 0):
        kv, rows, tags = engine.snapshot(b)
        assert kv == before[b][0]
        np.testing.assert_array_equal(rows, before[b][1])
        np.testing.assert_array_equal(tags, before[b][2])
    assert engine.client.stats.storage_miss_blocks == 2


def _flip_stored_byte(storage_url: str, key: str) -> None:
    store = open_blob_store(storage_url, NAMESPACE)
    blob = bytearray(store.get(key))
    blob[len(blob) // 2] ^= 0x01  # inside the KV payload
    store.blobs.put(store.blob_key(key), bytes(blob))  # under the engine's checks, as a bad disk would


def test_untagged_rows_are_never_stored_and_bad_tasks_do_not_kill_the_ctm(tmp_path) -> None:
    """Block 3 was never computed (tag 0): GPU2STORAGE refuses it; an out-of-range id is an error ack."""
    e = _start_engine(f"file://{tmp_path}")
    try:
        e.fill(1, tag=11, seed=9)
        ack = e.run(TransferKind.GPU2STORAGE, [1, 3], storage_keys=["aa", "bb"])
        assert ack.failed == [1] and "not all tagged" in ack.error
        ack = e.run(TransferKind.SWAP2CPU, [1, 99], cpu_block_ids=[0, 1])
        assert not ack.ok and ack.failed == [0, 1] and "out of range" in ack.error
        assert e.client.is_alive()
        assert e.run(TransferKind.SWAP2CPU, [1], cpu_block_ids=[0]).ok
    finally:
        _stop_engine(e)


def test_a_partial_last_block_is_stored_with_its_tokens_only(tmp_path) -> None:
    """PD's prefill server stores its prompt's partial last block (tail_tokens): GPU block 1 holds 2 tokens
    of the request (tag 11); its slots 2 and 3 hold what another request left (tag 77). Stored with
    tail_tokens=2 and loaded into block 4: slots 0-1 are the request's KV and rows, slots 2-3 zero KV and
    "no route" rows, all under the load's tag. Without tail_tokens the block is refused (two writers); a tail of a whole
    block or more is a bad task."""
    e = _start_engine(f"file://{tmp_path}")
    try:
        e.fill(1, tag=11, seed=21)
        e.fill(2, tag=77, seed=22)
        slot = slice(2, BS)
        for kv in e.kv:
            kv[:, :, 1, slot] = kv[:, :, 2, slot]  # another request's KV in the block's last two slots
        e.host.write(e.snapshot(2)[1][slot], block_slots([1], BS)[slot], np.full(BS - 2, 77, np.int64))
        kv_before, rows_before, _ = e.snapshot(1)
        assert "not all tagged" in e.run(TransferKind.GPU2STORAGE, [1], storage_keys=["c0" * 16]).error
        ack = e.run(TransferKind.GPU2STORAGE, [1], storage_keys=["c1" * 16], routing_tags=[11], tail_tokens=2)
        assert ack.ok, ack.error
        assert e.run(TransferKind.STORAGE2GPU, [4], storage_keys=["c1" * 16], routing_tags=[31]).ok
        kv_after, rows_after, tags = e.snapshot(4)
        for rank in range(TP):
            want = np.frombuffer(kv_before[rank], np.uint8).reshape(LAYERS, 2, BS, -1).copy()
            want[:, :, 2:] = 0
            assert kv_after[rank] == want.tobytes()
        np.testing.assert_array_equal(rows_after[:2], rows_before[:2])
        assert (rows_after[2:] == e.host.sentinel).all() and tags.tolist() == [31] * BS
        bad = e.run(TransferKind.GPU2STORAGE, [1], storage_keys=["c2" * 16], routing_tags=[11], tail_tokens=BS)
        assert not bad.ok and "tail_tokens" in bad.error and e.client.is_alive()
    finally:
        _stop_engine(e)


def test_killed_ctm_makes_wait_raise_promptly_and_shutdown_cleans_its_shm() -> None:
    """SIGKILL the CTM mid-flight: wait() raises within seconds, is_alive() is False, no segment is left."""
    e = _start_engine(None)
    try:
        ctm_segments = [n for n in list_segments(e.suffix) if "kv_cpu" in n or "routing_swap" in n]
        assert len(ctm_segments) == TP + 1
        os.kill(e.client.pid, signal.SIGSTOP)  # freeze it so that task 1 is surely in flight
        e.client.submit(TransferTask(1, TransferKind.SWAP2CPU, [1], cpu_block_ids=[0]))
        os.kill(e.client.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(CacheTransferError, match=r"exited with code -9; tasks \[1\] are lost"):
            e.client.wait(1, timeout=30)
        assert time.monotonic() - t0 < 5
        assert not e.client.is_alive()
    finally:
        _stop_engine(e)  # asserts that no fdr3_<suffix>_* segment is left


def test_sigterm_ctm_unlinks_its_own_shm() -> None:
    """SIGTERM (what the engine sends on shutdown) unwinds the CTM, which unlinks the CPU tier itself."""
    e = _start_engine(None)
    try:
        pid = e.client.pid
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while e.client.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not e.client.is_alive()
        left = [n for n in list_segments(e.suffix) if "kv_cpu" in n or "routing_swap" in n]
        assert left == []
    finally:
        _stop_engine(e)


def test_ctm_exits_and_unlinks_its_shm_when_the_engine_dies() -> None:
    """An engine process that starts a CTM and dies without shutdown() leaves no CPU tier behind."""
    script = (
        "import os, sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import test_cache_transfer_manager as t; "
        "e = t._start_engine(None); print(e.suffix, flush=True); os._exit(0)"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))
    out = subprocess.run([sys.executable, "-c", script, here, repo], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    suffix = out.stdout.split()[-1]
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            left = [n for n in list_segments(suffix) if "kv_cpu" in n or "routing_swap" in n]
            if not left:
                break
            time.sleep(0.05)
        assert left == []
    finally:
        unlink_all(suffix)  # the dead engine's own "GPU" segments


def test_a_pd_transfer_refused_cleanly_is_a_failed_ack_and_one_of_unknown_end_ends_the_ctm() -> None:
    """PD2GPU (cache_manager/pd_receive.py): a prefill server nobody listens for is a failed load and the
    CTM serves on; one that took the request and never answered might still write into blocks the engine
    will give to others, so the CTM exits without an ack (its tasks lost, its own segments unlinked)."""
    import socket
    import threading

    from fastdeploy_r3.cache_manager.storage import BlockLayout
    from fastdeploy_r3.cache_manager.transfer import RemoteBlocks

    blob = BlockLayout(TP, (LAYERS, 2, BS, HEADS, HEAD_DIM), "float32", 4, (BS, L, K), "uint8").blob_nbytes
    e = _start_engine(None)
    listener = socket.socket()
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        room = RemoteBlocks("127.0.0.1", closed, 5, blob, (1,))
        ack = e.run(TransferKind.PD2GPU, [2], routing_tags=[7], remote=room)
        assert ack.failed == [0] and "unreachable" in ack.error and e.client.is_alive()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        held: list[socket.socket] = []
        threading.Thread(target=lambda: held.append(listener.accept()[0]), daemon=True).start()
        silent = RemoteBlocks("127.0.0.1", listener.getsockname()[1], 6, blob, (1,), timeout_s=0.5)
        e.client.submit(TransferTask(99, TransferKind.PD2GPU, [2], routing_tags=[7], remote=silent))
        with pytest.raises(CacheTransferError, match=r"tasks \[99\] are lost"):
            e.client.wait(99, timeout=20)
        assert not e.client.is_alive()
        assert [n for n in list_segments(e.suffix) if "kv_cpu" in n or "routing_swap" in n] == []
    finally:
        listener.close()
        _stop_engine(e)


def test_a_pd_transfer_waiting_on_the_network_does_not_hold_up_the_tasks_behind_it() -> None:
    """PD2GPU runs beside the FIFO (ctm_process.py): a swap submitted after a room whose prefill server
    takes 1.5 s to answer is acked first; the room's ack follows (here P answers 404: a failed load)."""
    import socket
    import threading

    from fastdeploy_r3.cache_manager.storage import BlockLayout
    from fastdeploy_r3.cache_manager.transfer import RemoteBlocks

    blob = BlockLayout(TP, (LAYERS, 2, BS, HEADS, HEAD_DIM), "float32", 4, (BS, L, K), "uint8").blob_nbytes
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def slow_p() -> None:
        conn, _ = listener.accept()
        time.sleep(1.5)
        conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        conn.close()

    threading.Thread(target=slow_p, daemon=True).start()
    e = _start_engine(None)
    try:
        e.fill(1, tag=11, seed=3)
        room = RemoteBlocks("127.0.0.1", listener.getsockname()[1], 8, blob, (1,), timeout_s=10.0)
        e.client.submit(TransferTask(1, TransferKind.PD2GPU, [2], routing_tags=[7], remote=room))
        t0 = time.monotonic()
        e.client.submit(TransferTask(2, TransferKind.SWAP2CPU, [1], cpu_block_ids=[0]))
        assert e.client.wait(2, timeout=20).ok and time.monotonic() - t0 < 1.0
        ack = e.client.wait(1, timeout=20)
        assert ack.failed == [0] and "answered 404" in ack.error and time.monotonic() - t0 >= 1.4
        assert e.client.is_alive()
    finally:
        listener.close()
        _stop_engine(e)
