"""Start-up: start the engine's parts in order and hand them back declared in one dataclass.

    workers (one per TP rank)  ── WorkerReady: KV blocks per rank, KV spec, lookahead
    routing_host_buffer        ── SHM [num_gpu_blocks * block_size, L, K], attached by rank 0
    lookup-only KV store       ── StorageLookup (prefix lookups off the loop)
    CacheTransferManager       ── when a CPU tier or a storage tier is configured
    PrefixCacheManager ── Scheduler ── TokenProcessor (── RoutingCacheManager)

What needs closing lives in EngineResources, filled in the order it is opened and closed in reverse
(`close`), whether start-up finished or failed half way; the rest holds no process or file.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields

from fastdeploy_r3.cache_manager.block_hash import root_hash
from fastdeploy_r3.cache_manager.kv_connector import KVConnector
from fastdeploy_r3.cache_manager.prefix_cache_manager import PrefixCacheManager
from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer, RoutingBufferSpec
from fastdeploy_r3.cache_manager.shm import shm_name, unlink_all
from fastdeploy_r3.cache_manager.storage_lookup import StorageLookup
from fastdeploy_r3.cache_manager.transfer_supervisor import TransferSupervisor
from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.engine.scheduler import Scheduler
from fastdeploy_r3.engine.token_processor import TokenProcessor
from fastdeploy_r3.engine.worker_group import WorkerGroup
from fastdeploy_r3.sampling_params import SamplingParams
from fastdeploy_r3.worker.messages import AttachRoutingBuffer, WorkerReady

logger = logging.getLogger(__name__)

# "1": admission waits for every storage-tier load, stalling the loop as before loads ran in the
# background (a switch to compare against, or to fall back on)
BLOCKING_LOADS_ENV = "FDR3_BLOCKING_STORAGE_LOADS"


@dataclass
class EngineResources:
    """Everything the engine opened, in opening order; `close` undoes it in reverse, once."""

    suffix: str  # of every SHM segment and socket of this engine
    workers: WorkerGroup | None = None
    routing_host: RoutingBuffer | None = None
    lookup: StorageLookup | None = None  # owns the lookup-only KV store (the CTM writes) and closes it
    transfers: TransferSupervisor | None = None  # the cache transfer manager, over its life

    def stop_children(self) -> None:
        """Stop the processes and free the shared memory (a dead engine does this at once). The CTM
        first: on CUDA it maps the workers' KV through IPC handles, released before their exporter exits."""
        if self.transfers is not None:
            self.transfers.stop()
            self.transfers = None
        if self.routing_host is not None:
            self.routing_host.close()
            self.routing_host = None
        if self.workers is not None:
            self.workers.stop()
            self.workers = None
        unlink_all(self.suffix)

    def close(self) -> None:
        """Close everything still open, newest first; idempotent."""
        if self.transfers is not None:
            self.transfers.stop()
            self.transfers = None
        if self.lookup is not None:
            self.lookup.close()  # and its store: a Mooncake client takes the objects of its segment with it
            self.lookup = None
        self.stop_children()


@dataclass
class EngineParts:
    """The engine once started; `resources` is what shutdown closes."""

    resources: EngineResources
    tokenizer: object | None  # engine/tokenizer.py's Tokenizer, None for token-id-only models
    eos_token_ids: list[int]
    max_model_len: int  # the config's, lowered to what the KV cache holds (the config stays as asked)
    num_gpu_blocks: int
    num_cpu_blocks: int
    kv: PrefixCacheManager
    scheduler: Scheduler
    token_processor: TokenProcessor

    @property
    def workers(self) -> WorkerGroup:
        assert self.resources.workers is not None, "the workers were stopped"
        return self.resources.workers


def build_engine(config: EngineConfig, suffix: str, runner_cls: type | None = None) -> EngineParts:
    """Start every part; on failure close what was opened and re-raise. runner_cls: the workers'
    model runner (worker/model_runner.py's ModelRunner unless given)."""
    res = EngineResources(suffix)
    try:
        return _build(config, res, runner_cls)
    except BaseException:
        res.close()
        raise


def _build(cfg: EngineConfig, res: EngineResources, runner_cls: type | None) -> EngineParts:
    mc, cc, sc, rr = cfg.model_config, cfg.cache_config, cfg.scheduler_config, cfg.routing_replay_config
    # the ranks start (torch, the model) while this process loads the tokenizer (transformers: seconds)
    res.workers = WorkerGroup(cfg, res.suffix, runner_cls=runner_cls)
    tokenizer = _load_tokenizer(mc.model)
    # as vLLM: the tokenizer's eos stops generation too, besides config.json's and generation_config.json's
    eos = list(dict.fromkeys([*mc.eos_token_ids, *(tokenizer.eos_token_ids if tokenizer else [])]))  # type: ignore[attr-defined]
    ignored = sorted(set(mc.generation_defaults) - {f.name for f in fields(SamplingParams)})
    if ignored:
        logger.warning("generation_config.json sets %s, which this engine does not implement; requests are "
                       "sampled without it", ", ".join(f"{k}={mc.generation_defaults[k]}" for k in ignored))

    readies: list[WorkerReady] = res.workers.collect(timeout=600)
    num_gpu_blocks = min(r.num_gpu_blocks for r in readies)
    capacity = num_gpu_blocks * cc.block_size
    max_model_len = cfg.max_model_len
    if capacity < max_model_len:
        # A longer sequence could never fit even alone (preemption cannot help it), so the
        # engine's own limit, and the server's default max_tokens, follow the cache.
        logger.warning("max_model_len %d lowered to %d, what %d KV blocks of %d tokens hold",
                       max_model_len, capacity, num_gpu_blocks, cc.block_size)
        max_model_len = capacity

    routing_spec = None
    if rr.enable_routing_replay:
        routing_spec = RoutingBufferSpec(
            name=shm_name(res.suffix, "routing_host"),
            num_slots=num_gpu_blocks * cc.block_size,
            num_layers=rr.num_moe_layers,
            top_k=rr.moe_top_k,
            dtype=rr.routing_dtype.name,  # type: ignore[union-attr]
        )
        res.routing_host = RoutingBuffer.create(routing_spec)
    res.workers.call(AttachRoutingBuffer(routing_spec), timeout=120)

    num_cpu_blocks = 0
    if cc.enable_prefix_caching and cc.has_cpu_tier:
        num_cpu_blocks = (  # swap_space is per worker rank, as in vLLM
            cc.num_cpu_blocks_override
            if cc.num_cpu_blocks_override is not None
            else int(cc.swap_space * 2**30 // readies[0].kv_spec.block_nbytes)
        )
    namespace = f"{mc.model_identity}|{mc.weight_version}"
    if cc.enable_prefix_caching and cc.kv_storage:
        from fastdeploy_r3.blobstore import open_blob_store

        storage = open_blob_store(cc.kv_storage, namespace, cc.storage_timeout_s, ttl_s=cc.kv_storage_ttl_s,
                                  lookup_only=True)  # the CTM writes
        try:
            res.lookup = StorageLookup(storage, cc.storage_timeout_s, storage.health,
                                       remember_stored=max(4096, 4 * num_gpu_blocks))
        except BaseException:
            storage.close()
            raise
    connectors: list[KVConnector] = []
    if num_cpu_blocks > 0 or res.lookup is not None:
        from fastdeploy_r3.cache_manager.transfer import CacheTransferConfig

        res.transfers = TransferSupervisor(CacheTransferConfig(
            kv_specs=[r.kv_spec for r in readies],
            num_cpu_blocks=num_cpu_blocks,
            block_size=cc.block_size,
            routing_host=routing_spec,
            routing_swap_name=shm_name(res.suffix, "routing_swap") if routing_spec else None,
            kv_cpu_name=shm_name(res.suffix, "kv_cpu"),
            storage_url=cc.kv_storage if res.lookup is not None else None,
            storage_namespace=namespace,
            parent_pid=os.getpid(),
            engine_suffix=res.suffix,
            pd_receiver=cc.pd_receiver,
            storage_timeout_s=cc.storage_timeout_s,
            storage_ttl_s=cc.kv_storage_ttl_s,
            storage_capacity_bytes=(None if cc.kv_storage_capacity_gib is None
                                    else int(cc.kv_storage_capacity_gib * 2**30)),
        ), timeout_s=cc.transfer_timeout_s)
        res.transfers.start()
        from fastdeploy_r3.cache_manager.cpu_tier import CpuTier
        from fastdeploy_r3.cache_manager.storage_tier import StorageTier

        if num_cpu_blocks > 0:
            connectors.append(CpuTier(num_cpu_blocks, res.transfers))
        if res.lookup is not None:
            connectors.append(StorageTier(res.lookup, res.transfers))
    kv = PrefixCacheManager(
        num_gpu_blocks=num_gpu_blocks,
        block_size=cc.block_size,
        enable_prefix_caching=cc.enable_prefix_caching,
        root_hash=root_hash(mc.model_identity, mc.weight_version),
        connectors=connectors,
    )
    scheduler = Scheduler(kv, sc.max_num_seqs, sc.max_num_batched_tokens, sc.enable_chunked_prefill,
                          max_waiting=sc.max_waiting_requests, num_lookahead_tokens=readies[0].num_lookahead_tokens,
                          max_model_len=max_model_len,
                          nonblocking_loads=os.environ.get(BLOCKING_LOADS_ENV, "0") != "1")
    routing = None
    if res.routing_host is not None:
        from fastdeploy_r3.cache_manager.routing_cache_manager import RoutingCacheManager

        routing = RoutingCacheManager(res.routing_host, cc.block_size, num_experts=rr.num_experts,
                                      debug_mode=rr.debug_mode)
    token_processor = TokenProcessor(scheduler, tokenizer, eos, max_model_len, routing)
    return EngineParts(res, tokenizer, eos, max_model_len, num_gpu_blocks, num_cpu_blocks, kv, scheduler,
                       token_processor)


def _load_tokenizer(model: str) -> object | None:
    try:
        from fastdeploy_r3.engine.tokenizer import load_tokenizer

        return load_tokenizer(model)
    except Exception as e:  # token-id-only models are served too
        logger.warning("no tokenizer loaded (%s); only token-id prompts are accepted", e)
        return None
