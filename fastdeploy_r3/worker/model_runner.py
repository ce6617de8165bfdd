"""Runs one step of the model for a batch of request chunks on one TP rank.

Per step:  prepare inputs → forward (MoE layers capture top-k ids) → rank 0 writes the step's R3 rows
into routing_host_buffer at slot_mapping → sample → return tokens. The R3 write happens before
the tokens leave the worker, so when the engine sees a token, every forwarded row is in place.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer, RoutingBufferSpec
from fastdeploy_r3.cache_manager.shm import ShmSegment, shm_free_bytes, shm_name
from fastdeploy_r3.cache_manager.slots import slots_of
from fastdeploy_r3.cache_manager.transfer import KVCacheSpec
from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.dtypes import torch_dtype
from fastdeploy_r3.model_executor.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from fastdeploy_r3.sampling_params import SamplingParams
from fastdeploy_r3.worker.messages import ScheduledRequestData, StepInput, StepOutput
from fastdeploy_r3.worker.routing_capture import RoutingCapture
from fastdeploy_r3.worker.routing_writer import RoutingWriter, make_routing_writer
from fastdeploy_r3.worker.sampler import sample_token

logger = logging.getLogger(__name__)



class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int, world_size: int, engine_suffix: str) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.engine_suffix = engine_suffix
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        self.dtype = torch_dtype(config.model_config.dtype)
        self.block_size = config.cache_config.block_size
        self.model: torch.nn.Module | None = None
        self.kv_cache: torch.Tensor | None = None  # [num_layers, 2, NB, BS, KVH, D]
        self._kv_segment: ShmSegment | None = None
        self.routing_host: RoutingBuffer | None = None
        self.routing_writer: RoutingWriter | None = None  # rank 0 only: writes into routing_host
        self.routing_capture: RoutingCapture | None = None
        self._params: dict[str, SamplingParams] = {}
        self._generators: dict[str, torch.Generator] = {}

    # -- start-up -----------------------------------------------------------------------------------

    def load_model(self) -> None:
        from fastdeploy_r3.model_executor.model_loader import load_model

        torch.manual_seed(self.config.model_config.seed)
        self.model = load_model(self.config.model_config, self.device, self.rank, self.world_size)

    def kv_bytes_per_block(self) -> int:
        m = self.model
        assert m is not None
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return m.num_layers * 2 * self.block_size * m.num_kv_heads * m.head_dim * elem

    def determine_num_gpu_blocks(self) -> int:
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1.0 - cc.gpu_memory_utilization)
        else:
            budget = cc.kv_cache_space_gib * 2**30
        n = int(budget // per_block)
        if n < 2:
            raise RuntimeError(
                f"the KV cache budget holds {n} blocks of {per_block} bytes; raise kv_cache_space_gib / "
                "gpu_memory_utilization or set num_gpu_blocks_override"
            )
        return n

    def init_kv_cache(self, num_gpu_blocks: int) -> KVCacheSpec:
        m = self.model
        assert m is not None
        shape = (m.num_layers, 2, num_gpu_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        dtype_name = self.config.model_config.dtype
        name = shm_name(self.engine_suffix, f"kv_rank{self.rank}")
        if self.device.type == "cuda":
            # On GPU the cache lives in device memory; the CTM maps it through a CUDA IPC handle, valid
            # while self.kv_cache lives (until close()).
            from torch.multiprocessing.reductions import reduce_tensor

            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            # Export a handle only for a CTM to map: an exported tensor nobody imports makes torch warn
            # at exit that the producer died before its consumers released it.
            ipc = reduce_tensor(self.kv_cache) if self.config.cache_config.uses_transfer_manager else None
            return KVCacheSpec(name, shape, dtype_name, device="cuda", cuda_ipc=ipc)
        else:
            nbytes = int(np.prod(shape)) * torch.tensor([], dtype=self.dtype).element_size()
            if nbytes > shm_free_bytes():
                raise RuntimeError(
                    f"/dev/shm has {shm_free_bytes() / 2**20:.0f} MiB free, the KV cache needs "
                    f"{nbytes / 2**20:.0f} MiB; lower num_gpu_blocks_override / kv_cache_space_gib"
                )
            self._kv_segment = ShmSegment.create(name, nbytes)
            self.kv_cache = self._kv_segment.torch(shape, self.dtype)
            self.kv_cache.zero_()
        return KVCacheSpec(name=name, shape=shape, dtype=dtype_name, device=self.device.type)

    def attach_routing(self, spec: RoutingBufferSpec | None) -> None:
        rr = self.config.routing_replay_config
        if spec is None or not rr.enable_routing_replay:
            return
        if self.rank == 0:
            self.routing_host = RoutingBuffer.attach(spec)
            self.routing_writer = make_routing_writer(self.routing_host, self.device, rr.debug_mode)
        self.routing_capture = RoutingCapture(
            max_num_batched_tokens=self.config.scheduler_config.max_num_batched_tokens,
            num_moe_layers=rr.num_moe_layers,
            top_k=rr.moe_top_k,
            num_experts=rr.num_experts,
            routing_dtype=rr.routing_dtype,
            debug_mode=rr.debug_mode,
            device=self.device,
        )

    # -- steps --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        for rid in step.finished_request_ids:
            self._params.pop(rid, None)
            self._generators.pop(rid, None)
        if not step.requests:
            return StepOutput(step.step_id, {})
        model = self.model
        assert model is not None and self.kv_cache is not None
        bs = self.block_size

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tags: list[int] = []
        query_start_loc = [0]
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[tuple[int, ScheduledRequestData]] = []
        for r in step.requests:
            self._remember(r)
            n = len(r.token_ids)
            pos = np.arange(r.start_pos, r.start_pos + n, dtype=np.int64)
            input_ids.extend(r.token_ids)
            positions.extend(pos.tolist())
            slots.extend(slots_of(r.block_table, pos, bs).tolist())
            tags.extend(np.asarray(r.block_tags, dtype=np.int64)[pos // bs].tolist())
            query_lens.append(n)
            seq_lens.append(r.start_pos + n)
            query_start_loc.append(query_start_loc[-1] + n)
            if r.sample:
                sample_rows.append((query_start_loc[-1] - 1, r))

        max_blocks = max(len(r.block_table) for r in step.requests)
        tables = torch.zeros((len(step.requests), max_blocks), dtype=torch.int64)
        for i, r in enumerate(step.requests):
            tables[i, : len(r.block_table)] = torch.tensor(r.block_table, dtype=torch.int64)
        dev = self.device
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=dev)  # [T]
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)  # [T]
        slot_t = torch.tensor(slots, dtype=torch.int64, device=dev)  # [T]
        meta = AttentionMetadata(
            slot_mapping=slot_t,
            query_start_loc=query_start_loc,
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=tables.to(dev),
            block_size=bs,
        )
        kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(self.kv_cache.shape[0])]
        capture = self.routing_capture
        if capture is not None:
            capture.begin_step(len(input_ids), pos_t)
        with set_forward_context(ForwardContext(meta, kv_caches, capture)):
            hidden = model(ids_t, pos_t)  # [T, H]

        if capture is not None:
            capture.check_complete()
            if self.routing_writer is not None:
                tags_t = torch.tensor(tags, dtype=torch.int64, device=dev)  # [T]
                rows = self.routing_writer.rows_of(capture, len(input_ids))  # [T, L, K]
                self.routing_writer.write(rows, slot_t, tags_t, pos_t)

        sampled: dict[str, int] = {}
        # every rank holds the same hidden states (all-reduced) and the engine reads rank 0's tokens only
        if sample_rows and self.rank == 0:
            idx = torch.tensor([i for i, _ in sample_rows], dtype=torch.int64, device=dev)
            logits = model.compute_logits(hidden[idx]).float().cpu()  # [S, V]
            for row, (_, r) in enumerate(sample_rows):
                sampled[r.request_id] = sample_token(
                    logits[row], self._params[r.request_id], self._generators.get(r.request_id)
                )
        return StepOutput(step.step_id, sampled)

    def _remember(self, r: ScheduledRequestData) -> None:
        if r.sampling_params is not None:
            self._params[r.request_id] = r.sampling_params
            if r.sampling_seed is not None:
                self._generators[r.request_id] = torch.Generator().manual_seed(r.sampling_seed)

    def close(self) -> None:
        if self.routing_writer is not None:
            self.routing_writer.close()
            self.routing_writer = None
        if self.routing_host is not None:
            self.routing_host.close()
            self.routing_host = None
        self.kv_cache = None
        if self._kv_segment is not None:
            self._kv_segment.close()
            self._kv_segment = None
