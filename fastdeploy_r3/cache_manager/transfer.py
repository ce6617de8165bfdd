"""The boundary between the engine and the CacheTransferManager (CTM) subprocess: every message and
error that crosses it, and nothing else, so that the engine names them without importing the
subprocess module (or torch).

    engine ── TransferTask ─► CTM             (run one at a time, in submission order)
           ◄─ TransferAck ──────┘             (only once the data is in place)
           ◄─ CTMReady (once, after setup)
           ── lifecycle.Shutdown ─►           (the one stop message of every boundary)

A task names blocks by id in each tier. Routing rows always travel in the same task as the KV of
their block: the CTM moves both through one owner (block_copy.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastdeploy_r3.cache_manager.routing_buffer import RoutingBufferSpec
from fastdeploy_r3.config.dtypes import DTYPE_BYTES


class CacheTransferError(RuntimeError):
    """The CTM is gone or never came up; every in-flight transfer is lost (its blocks count as misses)."""


class CacheTransferTimeout(CacheTransferError, TimeoutError):
    """No ack in time; the CTM is alive but busy or stuck (it is killed and replaced)."""


@dataclass(frozen=True)
class CTMReady:
    """The CTM's first message: its CPU tier exists and its store answered (or why not)."""

    pid: int
    error: str | None = None  # set when setup failed; the CTM exits right after


class TransferKind(enum.Enum):
    SWAP2CPU = "swap2cpu"  # gpu_block_ids[i] -> cpu_block_ids[i]
    SWAP2GPU = "swap2gpu"  # cpu_block_ids[i] -> gpu_block_ids[i]
    GPU2STORAGE = "gpu2storage"  # gpu_block_ids[i] -> storage_keys[i]
    STORAGE2GPU = "storage2gpu"  # storage_keys[i] -> gpu_block_ids[i], rows stamped with routing_tags[i]
    PD2GPU = "pd2gpu"  # block first_block + i of a prefill server's room -> gpu_block_ids[i], as STORAGE2GPU


@dataclass(frozen=True)
class RemoteBlocks:
    """A prefill server's room whose prompt blocks it writes straight into the GPU blocks this
    engine reserved (PD, docs/pd.md): where to ask, and what each block must hash to once it landed."""

    host: str  # P's bootstrap server
    port: int
    room: int
    blob_nbytes: int  # one stored block blob (cache_manager/storage.py): this engine's layout or nothing
    block_digests: tuple[int, ...]  # per prompt block, the xxh3_64 trailer of its blob (header, KV, rows)
    # > 0: the last of block_digests is the prompt's partial last block, holding this many tokens
    # (cache_manager/prompt_tails.py); D loads it with the full blocks and computes from the prompt's end
    tail_tokens: int = 0
    timeout_s: float = 30.0  # the whole transfer; past it the outcome is unknown (pd_receive.py)


@dataclass
class TransferTask:
    task_id: int
    kind: TransferKind
    gpu_block_ids: list[int]
    cpu_block_ids: list[int] = field(default_factory=list)
    storage_keys: list[str] = field(default_factory=list)
    routing_tags: list[int] = field(default_factory=list)
    remote: RemoteBlocks | None = None  # PD2GPU: the room, its blocks from first_block on
    first_block: int = 0
    # GPU2STORAGE of a prefill server's partial last prompt block (PD): the task's last block holds only
    # this many tokens; their rows must carry its tag, and its slots after them are stored as zero KV and
    # "no route" rows
    tail_tokens: int = 0


@dataclass
class TransferAck:
    task_id: int
    kind: TransferKind
    ok: bool  # every block of the task is in place
    failed: list[int] = field(default_factory=list)  # indices into the task's lists that did not make it
    error: str | None = None
    nbytes: int = 0
    seconds: float = 0.0
    store_counters: dict[str, int] = field(default_factory=dict)  # storage tasks: the CTM's store totals


@dataclass(frozen=True)
class KVCacheSpec:
    """One worker rank's KV cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""

    name: str  # SHM segment name on CPU; on CUDA only a label, the tensor travels as `cuda_ipc`
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    device: str = "cpu"
    # On CUDA: torch.multiprocessing.reductions.reduce_tensor(kv_cache) = (rebuild_fn, args), plain
    # picklable data; another process calls rebuild_fn(*args) to map the worker's KV through CUDA IPC.
    # The worker keeps its tensor alive for as long as the handle is in use.
    cuda_ipc: tuple[Any, tuple] | None = None

    @property
    def num_blocks(self) -> int:
        return self.shape[2]

    @property
    def itemsize(self) -> int:
        size = DTYPE_BYTES.get(self.dtype)
        if size is None:
            raise TypeError(f"KV dtype {self.dtype!r} is not a KV cache dtype; use one of {', '.join(DTYPE_BYTES)}")
        return size

    @property
    def layer_block_nbytes(self) -> int:
        """Bytes of one (layer, K|V, block): block_size * num_kv_heads * head_dim * itemsize."""
        return int(np.prod(self.shape[3:])) * self.itemsize

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over all layers, K and V."""
        return self.shape[0] * 2 * self.layer_block_nbytes

    @property
    def block_size(self) -> int:
        return self.shape[3]


@dataclass(frozen=True)
class CacheTransferConfig:
    """Everything the CTM subprocess needs; it takes scalars and names, not the engine config."""

    kv_specs: list[KVCacheSpec]  # one per TP rank
    num_cpu_blocks: int
    block_size: int
    routing_host: RoutingBufferSpec | None  # None when R3 is off
    routing_swap_name: str | None  # SHM name of the routing_swap_buffer the CTM creates
    kv_cpu_name: str | None  # SHM name of the CPU-tier KV the CTM creates
    storage_url: str | None
    storage_namespace: str
    parent_pid: int
    storage_timeout_s: float = 30.0  # one storage call (Redis socket timeout)
    storage_must_answer: bool = True  # False: a store that is down at start is degraded, not an error
    storage_ttl_s: int | None = None  # stored blocks expire after it (where the store has expiry)
    storage_capacity_bytes: int | None = None  # a file tier's byte budget (least recently used go first)
    engine_suffix: str | None = None  # the engine's SHM suffix: a CTM outliving its engine unlinks all of them
    # a decode server of PD's mooncake backend: the CTM readies what prefill servers' writes need (its transfer
    # engine, the HTTP client) as it starts, instead of at the first transfer (~150 ms of imports and set-up)
    pd_receiver: bool = False

    def segment_names(self) -> list[str]:
        """SHM names the CTM creates; unlinking them by name also covers a CTM killed before it cleaned up."""
        names = [cpu_kv_name(self.kv_cpu_name, rank) for rank in range(len(self.kv_specs))] if self.kv_cpu_name else []
        return names + ([self.routing_swap_name] if self.routing_swap_name else [])


def cpu_kv_name(kv_cpu_name: str, rank: int) -> str:
    """SHM name of rank's CPU tier (CPU device only)."""
    return f"{kv_cpu_name}_rank{rank}"
