"""CacheTransferManager (CTM): the subprocess that moves KV blocks with their R3 rows between tiers.

    engine ── CacheTransferClient ──Pipe(TransferTask)──► CTM subprocess
           ◄──────────────────────────Pipe(TransferAck)──┘
    GPU tier  (per rank KV, routing_host_buffer)   created by engine/workers, CTM attaches
    CPU tier  (per rank KV, routing_swap_buffer)   created and owned by the CTM
    storage   (file:// or redis://)                one blob per block: KV of all ranks + its rows

On CUDA the GPU tier is the worker's device tensor, mapped here through its CUDA IPC handle
(KVCacheSpec.cuda_ipc), and the CPU tier is pinned host memory laid out block-major
[num_cpu_blocks, num_layers, 2, block_bytes], so each block (or run of consecutive blocks) is one
contiguous DMA. Copies are queued on the current stream and synchronised before the ack. Routing
rows live in SHM on every device and take the numpy path.

Tasks run one at a time in submission order, so a later task sees the effects of an earlier one
(e.g. SWAP2CPU of block 3 then GPU2STORAGE of the block reusing GPU id 3 is safe only after the
first ack; but the CTM itself never reorders). A block's routing rows always move in the same task
as its KV (DESIGN.md §5.3).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import torch

from fastdeploy_r3.cache_manager.routing_buffer import NO_TAG, RoutingBuffer, RoutingBufferSpec
from fastdeploy_r3.cache_manager.shm import ShmSegment, pid_alive, unlink_quietly
from fastdeploy_r3.cache_manager.storage import (
    BlockDecodeError,
    BlockLayout,
    KVStorageBackend,
    StorageError,
    decode_block,
    encode_block,
    make_storage_backend,
    validate_key,
)
from fastdeploy_r3.cache_manager.transfer import (
    CacheTransferConfig,
    KVCacheSpec,
    TransferAck,
    TransferKind,
    TransferTask,
)
from fastdeploy_r3.process_lifetime import exit_with_parent, name_this_process

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 0.5


class CacheTransferError(RuntimeError):
    """The CTM is gone or never came up; every in-flight transfer is lost."""


class CacheTransferTimeout(CacheTransferError, TimeoutError):
    """No ack in time; the CTM is alive but busy or stuck."""


@dataclass(frozen=True)
class CTMReady:
    pid: int
    error: str | None = None  # set when setup failed; the CTM exits right after


@dataclass(frozen=True)
class CTMShutdown:
    pass


def cpu_kv_name(kv_cpu_name: str, rank: int) -> str:
    return f"{kv_cpu_name}_rank{rank}"


def _attach_kv(spec: KVCacheSpec) -> tuple[ShmSegment, np.ndarray]:
    """A byte view [num_layers, 2, num_blocks, block_bytes] of one rank's KV cache.

    Copies are dtype-agnostic byte copies, so bfloat16 needs no numpy support.
    """
    seg = ShmSegment.attach(spec.name)
    num_layers, _, num_blocks = spec.shape[:3]
    return seg, seg.numpy((num_layers, 2, num_blocks, spec.layer_block_nbytes), np.uint8)


def _attach_cuda_kv(spec: KVCacheSpec) -> torch.Tensor:
    """The worker's CUDA KV cache mapped into this process, as bytes [num_layers, 2, num_blocks, block_bytes]."""
    if spec.cuda_ipc is None:
        raise ValueError(
            f"KV spec {spec.name} is on cuda but carries no cuda_ipc handle; the worker must set "
            "KVCacheSpec.cuda_ipc = torch.multiprocessing.reductions.reduce_tensor(kv_cache)"
        )
    rebuild, args = spec.cuda_ipc
    kv = rebuild(*args)
    if tuple(kv.shape) != tuple(spec.shape) or not kv.is_contiguous():
        raise ValueError(f"CUDA IPC tensor {tuple(kv.shape)} does not match the contiguous KV spec {spec.shape}")
    num_layers, _, num_blocks = spec.shape[:3]
    return kv.view(torch.uint8).view(num_layers, 2, num_blocks, spec.layer_block_nbytes)


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in ids, first id, length) of each run of consecutive ids: [4, 5, 9] -> [(0, 4, 2), (2, 9, 1)]."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if runs and b == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, b, 1))
    return runs


class CacheTransferManager:
    """Runs in the CTM subprocess; owns the CPU tier and the storage connection."""

    def __init__(self, config: CacheTransferConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self._attached: list[ShmSegment] = []
        self._owned: list[ShmSegment] = []
        self.cuda = config.kv_specs[0].device == "cuda" if config.kv_specs else False
        # CPU: numpy per rank [num_layers, 2, num_gpu_blocks, block_bytes] (SHM);
        # CUDA: uint8 device tensor per rank, same shape (CUDA IPC).
        self.gpu_kv: list = []
        # CPU: numpy per rank [num_layers, 2, num_cpu_blocks, block_bytes] (SHM);
        # CUDA: pinned uint8 tensor per rank [num_cpu_blocks, num_layers, 2, block_bytes].
        self.cpu_kv: list = []
        self.routing_host: RoutingBuffer | None = None
        self.routing_swap: RoutingBuffer | None = None
        self.storage: KVStorageBackend | None = None
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
            if spec.device not in ("cpu", "cuda") or (spec.device == "cuda") != self.cuda:
                raise ValueError(f"KV spec {spec.name} is on {spec.device!r}; every rank must be on 'cpu' or every "
                                 "rank on 'cuda'")  # fmt: skip
            if self.cuda:
                self.gpu_kv.append(_attach_cuda_kv(spec))
                continue
            seg, kv = _attach_kv(spec)
            self._attached.append(seg)
            self.gpu_kv.append(kv)
        self.num_gpu_blocks = cfg.kv_specs[0].num_blocks
        self.num_cpu_blocks = cfg.num_cpu_blocks if cfg.kv_cpu_name else 0
        for rank, kv in enumerate(self.gpu_kv):
            if self.num_cpu_blocks == 0:
                break
            num_layers, _, _, block_bytes = kv.shape
            if self.cuda:
                self.cpu_kv.append(torch.empty((self.num_cpu_blocks, num_layers, 2, block_bytes),
                                               dtype=torch.uint8, pin_memory=True))  # fmt: skip
                continue
            seg = ShmSegment.create(
                cpu_kv_name(cfg.kv_cpu_name, rank), num_layers * 2 * self.num_cpu_blocks * block_bytes
            )
            self._owned.append(seg)
            self.cpu_kv.append(seg.numpy((num_layers, 2, self.num_cpu_blocks, block_bytes), np.uint8))

        rows_shape = rows_dtype = None
        if cfg.routing_host is not None:
            host = cfg.routing_host
            self.routing_host = RoutingBuffer.attach(host)
            if host.num_slots != self.num_gpu_blocks * self.block_size:
                raise ValueError(f"routing_host_buffer has {host.num_slots} slots, KV has {self.num_gpu_blocks} blocks")
            if self.num_cpu_blocks and cfg.routing_swap_name:
                swap = RoutingBufferSpec(cfg.routing_swap_name, self.num_cpu_blocks * self.block_size,
                                         host.num_layers, host.top_k, host.dtype)  # fmt: skip
                self.routing_swap = RoutingBuffer.create(swap)
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
            self.storage = make_storage_backend(cfg.storage_url, cfg.storage_namespace)

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
            }[task.kind]
            nbytes, failed, error = run(task)
        except Exception as e:  # a bad task must not take the CTM (and every other transfer) down
            logger.exception("CTM: task %s (%s) failed", task.task_id, task.kind)
            n = len(task.gpu_block_ids)
            return TransferAck(task.task_id, task.kind, ok=False, failed=list(range(n)), error=f"{e}",
                               seconds=time.perf_counter() - t0)  # fmt: skip
        return TransferAck(task.task_id, task.kind, ok=not failed, failed=failed, error=error, nbytes=nbytes,
                           seconds=time.perf_counter() - t0)  # fmt: skip

    def _validate(self, task: TransferTask) -> None:
        n = len(task.gpu_block_ids)
        _check_ids("gpu_block_ids", task.gpu_block_ids, self.num_gpu_blocks, unique=True)
        if task.kind in (TransferKind.SWAP2CPU, TransferKind.SWAP2GPU):
            if not self.num_cpu_blocks:
                raise CacheTransferError("swap task but the CPU tier is off (num_cpu_blocks=0 or kv_cpu_name=None)")
            if len(task.cpu_block_ids) != n:
                raise ValueError(f"task {task.task_id}: {n} gpu_block_ids but {len(task.cpu_block_ids)} cpu_block_ids")
            _check_ids("cpu_block_ids", task.cpu_block_ids, self.num_cpu_blocks, unique=True)
            return
        if self.storage is None:
            raise CacheTransferError(f"{task.kind.value} task but no storage backend is configured (storage_url)")
        if len(task.storage_keys) != n:
            raise ValueError(f"task {task.task_id}: {n} gpu_block_ids but {len(task.storage_keys)} storage_keys")
        for k in task.storage_keys:
            validate_key(k)
        need_tags = task.kind == TransferKind.STORAGE2GPU and self.routing_host is not None
        if (need_tags or task.routing_tags) and len(task.routing_tags) != n:
            raise ValueError(f"task {task.task_id}: {n} blocks need {n} routing_tags, got {len(task.routing_tags)}")
        if need_tags and NO_TAG in task.routing_tags:
            raise ValueError(f"task {task.task_id}: routing tag {NO_TAG} means 'never written'; stamp real tags")

    def _swap(self, src_kv: list[np.ndarray], src_ids: list[int], dst_kv: list[np.ndarray], dst_ids: list[int],
              src_rows: RoutingBuffer | None, dst_rows: RoutingBuffer | None) -> int:  # fmt: skip
        nbytes = 0
        if self.cuda:
            nbytes = self._swap_cuda(src_ids, dst_ids, to_cpu=src_kv is self.gpu_kv)
            src_kv = dst_kv = []  # KV done; the rows below take the SHM path on every device
        for src, dst in zip(src_kv, dst_kv, strict=True):
            for s, d in zip(src_ids, dst_ids, strict=True):
                dst[:, :, d] = src[:, :, s]  # [num_layers, 2, block_bytes]
            nbytes += len(src_ids) * src.shape[0] * 2 * src.shape[3]
        if src_rows is not None and dst_rows is not None:
            s_slots = src_rows.block_slots(src_ids, self.block_size)
            d_slots = dst_rows.block_slots(dst_ids, self.block_size)
            dst_rows.rows[d_slots] = src_rows.rows[s_slots]  # [n * block_size, L, K]
            dst_rows.tags[d_slots] = src_rows.tags[s_slots]
            nbytes += len(s_slots) * (src_rows.rows[0].nbytes + 8)
        return nbytes

    def _swap_cuda(self, src_ids: list[int], dst_ids: list[int], to_cpu: bool) -> int:
        """KV of blocks src_ids -> dst_ids between the device and the pinned CPU tier; returns bytes moved.

        GPU->CPU: gather the blocks on the device into block-major order, then one async D2H copy per run
        of consecutive CPU ids. CPU->GPU: one async H2D copy per run into a device staging buffer, then
        a scatter into the KV cache. Synchronised before returning, so the caller may ack.
        """
        nbytes = 0
        for gpu, cpu in zip(self.gpu_kv, self.cpu_kv, strict=True):
            dev = gpu.device
            n = len(src_ids)
            if to_cpu:
                idx = torch.tensor(src_ids, dtype=torch.int64, device=dev)
                staged = gpu.index_select(2, idx).permute(2, 0, 1, 3).contiguous()  # [n, num_layers, 2, block_bytes]
                for pos, first, length in _runs(dst_ids):
                    cpu[first : first + length].copy_(staged[pos : pos + length], non_blocking=True)
            else:
                staged = torch.empty((n, *cpu.shape[1:]), dtype=torch.uint8, device=dev)  # [n, num_layers, 2, bb]
                for pos, first, length in _runs(src_ids):
                    staged[pos : pos + length].copy_(cpu[first : first + length], non_blocking=True)
                idx = torch.tensor(dst_ids, dtype=torch.int64, device=dev)
                gpu.index_copy_(2, idx, staged.permute(1, 2, 0, 3))
            torch.cuda.synchronize(dev)  # an ack only when the data is in place; `staged` lives until here
            nbytes += staged.numel()
        return nbytes

    def _gpu_blocks_to_host(self, block_ids: list[int]) -> list[np.ndarray]:
        """CUDA: per rank the KV bytes of block_ids as numpy [n, num_layers, 2, block_bytes] (storage put)."""
        out = []
        for gpu in self.gpu_kv:
            idx = torch.tensor(block_ids, dtype=torch.int64, device=gpu.device)
            out.append(gpu.index_select(2, idx).permute(2, 0, 1, 3).contiguous().cpu().numpy())
        return out

    def _host_blocks_to_gpu(self, block_ids: list[int], parts: list[list[np.ndarray]]) -> None:
        """CUDA: parts[i][rank] (KV bytes of one block) into GPU block block_ids[i] of each rank (storage get)."""
        if not block_ids:
            return
        for rank, gpu in enumerate(self.gpu_kv):
            host = torch.from_numpy(np.stack([p[rank].reshape(gpu.shape[0], 2, gpu.shape[3]) for p in parts]))
            staged = host.pin_memory().to(gpu.device, non_blocking=True)  # [n, num_layers, 2, block_bytes]
            idx = torch.tensor(block_ids, dtype=torch.int64, device=gpu.device)
            gpu.index_copy_(2, idx, staged.permute(1, 2, 0, 3))
            torch.cuda.synchronize(gpu.device)

    def _swap_to_cpu(self, task: TransferTask) -> tuple[int, list[int], str | None]:
        nbytes = self._swap(self.gpu_kv, task.gpu_block_ids, self.cpu_kv, task.cpu_block_ids,
                            self.routing_host, self.routing_swap)  # fmt: skip
        return nbytes, [], None

    def _swap_to_gpu(self, task: TransferTask) -> tuple[int, list[int], str | None]:
        nbytes = self._swap(self.cpu_kv, task.cpu_block_ids, self.gpu_kv, task.gpu_block_ids,
                            self.routing_swap, self.routing_host)  # fmt: skip
        return nbytes, [], None

    def _block_rows(self, block_id: int) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
        if self.routing_host is None:
            return None, None
        lo = block_id * self.block_size
        return self.routing_host.rows[lo : lo + self.block_size], self.routing_host.tags[lo : lo + self.block_size]

    def _gpu_to_storage(self, task: TransferTask) -> tuple[int, list[int], str | None]:
        assert self.storage is not None
        nbytes, failed, reasons = 0, [], []
        host_kv = self._gpu_blocks_to_host(task.gpu_block_ids) if self.cuda else None
        for i, (block_id, key) in enumerate(zip(task.gpu_block_ids, task.storage_keys, strict=True)):
            rows, tags = self._block_rows(block_id)
            if tags is not None:
                # Fail closed: rows that are unwritten or from two computations would be served as data by
                # every engine that loads this key, so such a block is not stored at all.
                want = task.routing_tags[i] if task.routing_tags else int(tags[0])
                if want == NO_TAG or not np.all(tags == want):
                    failed.append(i)
                    reasons.append(f"{i}: routing rows of GPU block {block_id} are not all tagged {want}")
                    continue
            kv_parts = [kv[:, :, block_id] for kv in self.gpu_kv] if host_kv is None else [h[i] for h in host_kv]
            blob = encode_block(self.layout, kv_parts, rows)
            try:
                self.storage.put(key, blob)
            except StorageError as e:
                failed.append(i)
                reasons.append(f"{i}: {e}")
                continue
            nbytes += len(blob)
        return nbytes, failed, _summary(failed, len(task.gpu_block_ids), "not stored", reasons)

    def _storage_to_gpu(self, task: TransferTask) -> tuple[int, list[int], str | None]:
        assert self.storage is not None
        nbytes, failed, reasons = 0, [], []
        cuda_ids: list[int] = []  # CUDA: verified blocks, written to the device in one batch below
        cuda_parts: list[list[np.ndarray]] = []
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
                failed.append(i)
                reasons.append(f"{i}: {e}")
                continue
            # Only a fully verified blob reaches the GPU slots; a failed block leaves them untouched.
            if self.cuda:
                cuda_ids.append(block_id)
                cuda_parts.append(kv_parts)
            else:
                for kv, part in zip(self.gpu_kv, kv_parts, strict=True):
                    kv[:, :, block_id] = part.reshape(kv.shape[0], 2, kv.shape[3])
            dst_rows, dst_tags = self._block_rows(block_id)
            if dst_rows is not None:
                dst_rows[:] = rows
                dst_tags[:] = task.routing_tags[i]  # rows are data only under this engine's fresh tag
            nbytes += len(blob)
        self._host_blocks_to_gpu(cuda_ids, cuda_parts)
        return nbytes, failed, _summary(failed, len(task.gpu_block_ids), "missing or corrupt in storage", reasons)

    def close(self) -> None:
        for buf in (self.routing_swap, self.routing_host):
            if buf is not None:
                buf.close()
        self.routing_swap = self.routing_host = None
        self.gpu_kv, self.cpu_kv = [], []
        for seg in self._owned + self._attached:
            seg.close()
        self._owned, self._attached = [], []
        if self.storage is not None:
            self.storage.close()
            self.storage = None


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


# ---- subprocess entry ------------------------------------------------------------------------------

_EOF = object()


def _reader(conn: Connection, inbox: queue.Queue) -> None:
    # Drain the pipe in its own thread so that the engine's submit() never blocks on a busy CTM, and a
    # closed pipe (engine gone) is noticed even in the middle of a long task.
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        inbox.put(_EOF)


def run_cache_transfer_manager(config: CacheTransferConfig, conn: Connection) -> None:
    """Entry point of the CTM subprocess: set up, say ready, run tasks FIFO until told or orphaned."""
    logging.basicConfig(level=logging.INFO, format="[CTM %(process)d] %(levelname)s %(message)s")

    def _on_sigterm(signum: int, frame: object) -> None:
        raise SystemExit(0)  # unwinds into the finally below, which unlinks the CPU tier

    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the engine stops us
    ppid = os.getppid()  # reparenting means the process that started us died, even if parent_pid lives
    ctm = None
    try:
        exit_with_parent(ppid)  # SIGTERM the moment the engine dies, even in the middle of a task
        name_this_process("fdr3-ctm")
        try:
            ctm = CacheTransferManager(config)
        except Exception as e:
            logger.exception("CTM setup failed")
            conn.send(CTMReady(os.getpid(), error=f"{type(e).__name__}: {e}"))
            return
        conn.send(CTMReady(os.getpid()))
        inbox: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(conn, inbox), daemon=True, name="ctm-reader").start()
        while True:
            try:
                item = inbox.get(timeout=_PARENT_POLL_S)
            except queue.Empty:
                if not pid_alive(config.parent_pid) or os.getppid() != ppid:
                    logger.warning("engine (pid %d) is gone; CTM exits", config.parent_pid)
                    return
                continue
            if item is _EOF or isinstance(item, CTMShutdown):
                return
            conn.send(ctm.run_task(item))
    except (BrokenPipeError, EOFError):
        return
    finally:
        if ctm is not None:
            ctm.close()
        unlink_ctm_segments(config)


def unlink_ctm_segments(config: CacheTransferConfig) -> None:
    """Names the CTM creates; unlinking by name also covers a CTM that was killed before close()."""
    if config.kv_cpu_name:
        for rank in range(len(config.kv_specs)):
            unlink_quietly(cpu_kv_name(config.kv_cpu_name, rank))
    if config.routing_swap_name:
        unlink_quietly(config.routing_swap_name)
