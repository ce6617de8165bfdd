"""CacheTransferManager (CTM): the subprocess that moves KV blocks with their R3 rows between tiers.

    engine ── CacheTransferClient ──Pipe(TransferTask)──► CTM subprocess
           ◄──────────────────────────Pipe(TransferAck)──┘
    GPU tier  (per rank KV, routing_host_buffer)   created by engine/workers, CTM attaches
    CPU tier  (per rank KV, routing_swap_buffer)   created and owned by the CTM
    storage   (file:// or redis://)                one blob per block: KV of all ranks + its rows
    PD        a prefill server's transfer engine   writes blocks into the GPU tier (pd_receive.py)

Every copy goes through BlockCopier (block_copy.py), which moves a block's KV (the device's KVTiers:
CpuKVTiers over SHM, CudaKVTiers over CUDA IPC and pinned memory) together with its routing rows;
this class validates tasks and talks to the storage tier, the same way whatever the device. The
messages and errors of this boundary are in transfer.py.

Tasks run one at a time in submission order, so a later task sees the effects of an earlier one
(e.g. SWAP2CPU of block 3 then GPU2STORAGE of the block reusing GPU id 3 is safe only after the
first ack; but the CTM itself never reorders). PD2GPU tasks alone run beside them, on threads: the
process side (entry point, task loop, exit) is ctm_process.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time

import numpy as np

from fastdeploy_r3.blobstore import open_blob_store
from fastdeploy_r3.blobstore.kv import KVStorageBackend, StorageError, validate_key
from fastdeploy_r3.cache_manager.block_copy import BlockCopier, BlockData
from fastdeploy_r3.cache_manager.kv_tiers import CpuKVTiers, KVTiers
from fastdeploy_r3.cache_manager.pd_receive import PdReceiver, PeerWriteUnknown
from fastdeploy_r3.cache_manager.routing_buffer import NO_TAG, RoutingBuffer, RoutingBufferSpec
from fastdeploy_r3.cache_manager.storage import (
    BlockDecodeError,
    BlockLayout,
    CorruptBlockError,
    decode_block,
    encode_block,
)
from fastdeploy_r3.cache_manager.transfer import (
    CacheTransferConfig,
    CacheTransferError,
    KVCacheSpec,
    TransferAck,
    TransferKind,
    TransferTask,
)
from fastdeploy_r3.r3.errors import sentinel_of

logger = logging.getLogger(__name__)



class CacheTransferManager:
    """Runs in the CTM subprocess; owns the CPU tier and the storage connection."""

    def __init__(self, config: CacheTransferConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.copier: BlockCopier | None = None
        self.storage: KVStorageBackend | None = None
        self.pd: PdReceiver | None = None  # started by the first PD2GPU task
        self._pd_lock = threading.Lock()  # PD2GPU tasks run on threads (ctm_process.py)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        cfg = self.config
        if not cfg.kv_specs:
            raise ValueError("CacheTransferConfig.kv_specs is empty; pass one KVCacheSpec per TP rank")
        for spec in cfg.kv_specs:
            if spec.block_size != cfg.block_size or spec.shape[1] != 2 or len(spec.shape) != 6:
                raise ValueError(f"KV spec {spec} is not [num_layers, 2, num_blocks, {cfg.block_size}, H, D]")
            if (spec.shape, spec.dtype) != (cfg.kv_specs[0].shape, cfg.kv_specs[0].dtype):
                # A stored block holds every rank's slice under one layout; ranks must shard KV heads evenly.
                raise ValueError(f"KV spec {spec} differs from rank 0's {cfg.kv_specs[0]}; TP ranks must match")
            if spec.device not in ("cpu", "cuda") or spec.device != cfg.kv_specs[0].device:
                raise ValueError(f"KV spec {spec.name} is on {spec.device!r}; every rank must be on 'cpu' or every "
                                 "rank on 'cuda'")  # fmt: skip
        self.num_gpu_blocks = cfg.kv_specs[0].num_blocks
        self.num_cpu_blocks = cfg.num_cpu_blocks if cfg.kv_cpu_name else 0
        # each piece is handed to the copier as soon as it exists, so that close() releases it on a failure
        self.copier = BlockCopier(make_kv_tiers(list(cfg.kv_specs), self.num_cpu_blocks, cfg.kv_cpu_name),
                                  self.block_size, None, None)
        rows_shape = rows_dtype = None
        if cfg.routing_host is not None:
            host = cfg.routing_host
            self.copier.routing_host = RoutingBuffer.attach(host)
            if host.num_slots != self.num_gpu_blocks * self.block_size:
                raise ValueError(f"routing_host_buffer has {host.num_slots} slots, KV has {self.num_gpu_blocks} blocks")
            if self.num_cpu_blocks and cfg.routing_swap_name:
                swap = RoutingBufferSpec(cfg.routing_swap_name, self.num_cpu_blocks * self.block_size,
                                         host.num_layers, host.top_k, host.dtype)  # fmt: skip
                self.copier.routing_swap = RoutingBuffer.create(swap)
            elif self.num_cpu_blocks:
                raise ValueError("R3 is on and the CPU tier exists but routing_swap_name is None")
            rows_shape, rows_dtype = (self.block_size, host.num_layers, host.top_k), host.dtype

        spec0 = cfg.kv_specs[0]
        num_layers, _, _, _, num_heads, head_dim = spec0.shape
        self.layout = BlockLayout(
            num_ranks=len(cfg.kv_specs),
            kv_shape=(num_layers, 2, self.block_size, num_heads, head_dim),
            kv_dtype=spec0.dtype,
            kv_itemsize=spec0.itemsize,
            rows_shape=rows_shape,
            rows_dtype=rows_dtype,
        )
        if cfg.storage_url:
            self.storage = open_blob_store(cfg.storage_url, cfg.storage_namespace, cfg.storage_timeout_s,
                                                cfg.storage_must_answer, cfg.storage_ttl_s, cfg.storage_capacity_bytes)

    # ---- tasks -------------------------------------------------------------------------------------

    def run_task(self, task: TransferTask) -> TransferAck:
        t0 = time.perf_counter()
        try:
            self._validate(task)
            run = {
                TransferKind.SWAP2CPU: self._swap_to_cpu,
                TransferKind.SWAP2GPU: self._swap_to_gpu,
                TransferKind.GPU2STORAGE: self._gpu_to_storage,
                TransferKind.STORAGE2GPU: self._storage_to_gpu,
                TransferKind.PD2GPU: self._pd_to_gpu,
            }[task.kind]
            nbytes, failed, error = run(task)
        except PeerWriteUnknown:
            raise  # the CTM must end before any ack: a late write could land in reused blocks (pd_receive.py)
        except Exception as e:  # a bad task must not take the CTM (and every other transfer) down
            logger.exception("CTM: task %s (%s) failed", task.task_id, task.kind)
            n = len(task.gpu_block_ids)
            return TransferAck(task.task_id, task.kind, ok=False, failed=list(range(n)), error=f"{e}",
                               seconds=time.perf_counter() - t0)  # fmt: skip
        return TransferAck(task.task_id, task.kind, ok=not failed, failed=failed, error=error, nbytes=nbytes,
                           seconds=time.perf_counter() - t0, store_counters=self._store_counters())  # fmt: skip

    def _store_counters(self) -> dict[str, int]:
        """Running totals of the storage tier as this CTM sees it (puts, refusals, evictions, failures)."""
        if self.storage is None:
            return {}
        out = {f"kv_storage_{k}": v for k, v in dataclasses.asdict(self.storage.counters).items()}
        out["kv_storage_failures"] = self.storage.health.counters.failures
        budget = getattr(self.storage, "budget", None)
        if budget is not None:
            out.update({f"kv_storage_{k}": v for k, v in dataclasses.asdict(budget.counters).items()})
        return out

    def _validate(self, task: TransferTask) -> None:
        n = len(task.gpu_block_ids)
        _check_ids("gpu_block_ids", task.gpu_block_ids, self.num_gpu_blocks, unique=True)
        if task.tail_tokens and (task.kind != TransferKind.GPU2STORAGE or not n
                                 or not 0 < task.tail_tokens < self.block_size):  # fmt: skip
            raise ValueError(f"task {task.task_id}: tail_tokens {task.tail_tokens} names a partial last block of a "
                             f"GPU2STORAGE task, 1 to {self.block_size - 1} tokens")
        if task.kind in (TransferKind.SWAP2CPU, TransferKind.SWAP2GPU):
            if not self.num_cpu_blocks:
                raise CacheTransferError("swap task but the CPU tier is off (num_cpu_blocks=0 or kv_cpu_name=None)")
            if len(task.cpu_block_ids) != n:
                raise ValueError(f"task {task.task_id}: {n} gpu_block_ids but {len(task.cpu_block_ids)} cpu_block_ids")
            _check_ids("cpu_block_ids", task.cpu_block_ids, self.num_cpu_blocks, unique=True)
            return
        if task.kind == TransferKind.PD2GPU:
            if task.remote is None or (self.copier.routing_host is not None and len(task.routing_tags) != n):
                raise ValueError(f"task {task.task_id}: a PD2GPU task needs its room and one routing tag per block")
            return
        if self.storage is None:
            raise CacheTransferError(f"{task.kind.value} task but no storage backend is configured (storage_url)")
        if len(task.storage_keys) != n:
            raise ValueError(f"task {task.task_id}: {n} gpu_block_ids but {len(task.storage_keys)} storage_keys")
        for k in task.storage_keys:
            validate_key(k)
        need_tags = task.kind == TransferKind.STORAGE2GPU and self.copier.routing_host is not None
        if (need_tags or task.routing_tags) and len(task.routing_tags) != n:
            raise ValueError(f"task {task.task_id}: {n} blocks need {n} routing_tags, got {len(task.routing_tags)}")
        if need_tags and NO_TAG in task.routing_tags:
            raise ValueError(f"task {task.task_id}: routing tag {NO_TAG} means 'never written'; stamp real tags")

    def _swap_to_cpu(self, task: TransferTask) -> tuple[int, list[int], str | None]:
        assert self.copier is not None
        return self.copier.swap_out(task.gpu_block_ids, task.cpu_block_ids), [], None

    def _swap_to_gpu(self, task: TransferTask) -> tuple[int, list[int], str | None]:
        assert self.copier is not None
        return self.copier.swap_in(task.cpu_block_ids, task.gpu_block_ids), [], None

    def _gpu_to_storage(self, task: TransferTask) -> tuple[int, list[int], str | None]:
        assert self.storage is not None and self.copier is not None
        nbytes, failed, reasons = 0, [], []
        blocks = self.copier.read(task.gpu_block_ids)
        for i, (block_id, key, data) in enumerate(zip(task.gpu_block_ids, task.storage_keys, blocks, strict=True)):
            if task.tail_tokens and i == len(blocks) - 1:
                data = _tail_only(data, task.tail_tokens, self.block_size)
            tags = data.tags
            if tags is not None:
                # Fail closed: rows that are unwritten or from two computations would be served as data by
                # every engine that loads this key, so such a block is not stored at all.
                want = task.routing_tags[i] if task.routing_tags else int(tags[0])
                if want == NO_TAG or not np.all(tags == want):
                    failed.append(i)
                    reasons.append(f"{i}: routing rows of GPU block {block_id} are not all tagged {want}")
                    continue
            blob = encode_block(self.layout, data.kv_parts, data.rows)
            try:
                self.storage.put(key, blob)
            except StorageError as e:
                failed.append(i)
                reasons.append(f"{i}: {e}")
                continue
            nbytes += len(blob)
        return nbytes, failed, _summary(failed, len(task.gpu_block_ids), "not stored", reasons)

    def _pd_to_gpu(self, task: TransferTask) -> tuple[int, list[int], str | None]:
        assert task.remote is not None
        return self.pd_receiver().receive(task.gpu_block_ids, task.routing_tags, task.remote, task.first_block)

    def pd_receiver(self) -> PdReceiver:
        """The transfer engine prefill servers write into, started on first use (or at start:
        CacheTransferConfig.pd_receiver), with the HTTP client it asks them through."""
        assert self.copier is not None
        with self._pd_lock:
            if self.pd is None:
                from fastdeploy_r3.http_clients import sync_client

                with sync_client(1.0):  # httpx imported, its TLS context built: ~0.1 s, once a process
                    pass
                kv = self.copier.kv  # host-memory blocks take P's writes directly; device blocks through a landing
                direct = isinstance(kv, CpuKVTiers)
                self.pd = PdReceiver(self.copier.routing_host, self.layout, self.block_size,
                                     gpu_kv=kv.gpu_kv if direct else None,
                                     host_to_blocks=None if direct else kv.host_to_blocks)  # fmt: skip
            return self.pd

    def _storage_to_gpu(self, task: TransferTask) -> tuple[int, list[int], str | None]:
        assert self.storage is not None and self.copier is not None
        nbytes, failed, reasons = 0, [], []
        ok_ids: list[int] = []  # verified blocks, written to the GPU tier in one batch below
        ok_blocks: list[BlockData] = []
        ok_tags: list[int] = []
        for i, (block_id, key) in enumerate(zip(task.gpu_block_ids, task.storage_keys, strict=True)):
            blob = self.storage.get(key)
            if blob is None:
                failed.append(i)
                reasons.append(f"{i}: miss")
                continue
            try:
                kv_parts, rows = decode_block(blob, self.layout)
            except BlockDecodeError as e:
                logger.warning("CTM: stored block %s is unusable (%s); treated as a miss", key, e)
                if isinstance(e, CorruptBlockError):
                    with contextlib.suppress(StorageError):
                        self.storage.delete([key])
                failed.append(i)
                reasons.append(f"{i}: {e}")
                continue
            # Only a fully verified blob reaches the GPU slots; a failed block leaves them untouched.
            ok_ids.append(block_id)
            ok_blocks.append(BlockData(kv_parts, rows, None))
            ok_tags.append(task.routing_tags[i] if task.routing_tags else NO_TAG)
            nbytes += len(blob)
        self.copier.write(ok_ids, ok_blocks, ok_tags)
        return nbytes, failed, _summary(failed, len(task.gpu_block_ids), "missing or corrupt in storage", reasons)

    def close(self) -> None:
        if self.pd is not None:  # before the copier: its memory is what the transfer engine registered
            self.pd.close()
            self.pd = None
        if self.copier is not None:
            self.copier.close()
            self.copier = None
        if self.storage is not None:
            self.storage.close()
            self.storage = None


def _tail_only(data: BlockData, num_tokens: int, block_size: int) -> BlockData:
    """A partial block as it is stored: its first num_tokens slots; after them KV zeros and rows "no route"
    (what those slots hold belongs to no one: the blob carries no bytes of another request, and a row read
    there before the decode server computes it fails R3's check), tags of the first slots only."""
    parts = []
    for part in data.kv_parts:  # [num_layers, 2, block_bytes], slot-major: block_size x (heads, head_dim)
        part = np.array(part)  # a copy: on a CPU engine these are views of its KV cache
        part[:, :, num_tokens * (part.shape[2] // block_size):] = 0
        parts.append(part)
    rows = None
    if data.rows is not None:
        rows = data.rows.copy()
        rows[num_tokens:] = sentinel_of(rows.dtype)
    return BlockData(parts, rows, None if data.tags is None else data.tags[:num_tokens])


def _check_ids(what: str, ids: list[int], num_blocks: int, unique: bool) -> None:
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{what} {bad} out of range [0, {num_blocks})")
    if unique and len(set(ids)) != len(ids):
        raise ValueError(f"{what} {ids} has duplicates; a block can be the target of one copy per task")


def _summary(failed: list[int], n: int, what: str, reasons: list[str]) -> str | None:
    if not failed:
        return None
    shown = "; ".join(reasons[:8]) + ("; ..." if len(reasons) > 8 else "")
    return f"{len(failed)} of {n} blocks {what}: {shown}"


def make_kv_tiers(specs: list[KVCacheSpec], num_cpu_blocks: int, kv_cpu_name: str | None) -> KVTiers:
    """The copier for the device the workers' KV caches live on (all ranks on one device kind): here, not
    in kv_tiers.py, so that kv_tiers_cuda.py (which builds on kv_tiers.py) is imported only for CUDA."""
    if specs[0].device == "cuda":
        from fastdeploy_r3.cache_manager.kv_tiers_cuda import CudaKVTiers  # torch only where CUDA is

        return CudaKVTiers(specs, num_cpu_blocks)
    return CpuKVTiers(specs, num_cpu_blocks, kv_cpu_name)
