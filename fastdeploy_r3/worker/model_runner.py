"""Runs one step of the model for a batch of request chunks on one TP rank.

Per step:  apply the step's block diffs and prepare inputs (input_batch.py, batch_state.py) → fill the
placeholders of a step scheduled ahead from the previous step's sampled ids (engine/overlap.py) →
forward (MoE layers capture top-k ids) → rank 0 writes the step's R3 rows into routing_host_buffer at
slot_mapping → sample → return tokens. The R3 write happens before
the tokens leave the worker, so when the engine sees a token, every forwarded row is in place.

A verify step (engine/speculative.py) forwards and writes the rows of every draft too; finish() returns
only the accepted drafts and the bonus token, and the engine publishes rows only below its cursor,
which moves over verified tokens alone (engine/token_processor.py append_tokens): a rejected draft's
row sits in a slot the next step overwrites and is never read.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer, RoutingBufferSpec
from fastdeploy_r3.cache_manager.shm import ShmSegment, shm_free_bytes, shm_name
from fastdeploy_r3.cache_manager.transfer import KVCacheSpec
from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.config.dtypes import torch_dtype
from fastdeploy_r3.distributed.parallel_state import cuda_index
from fastdeploy_r3.model_executor.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from fastdeploy_r3.worker.cuda_graph_runner import DecodeGraphs, attention_is_graph_safe
from fastdeploy_r3.worker.input_batch import InputBatcher, SampleRow, StepInputs
from fastdeploy_r3.worker.kv_budget import num_kv_blocks, usable_blocks
from fastdeploy_r3.worker.messages import StepInput, StepOutput
from fastdeploy_r3.worker.mtp_drafter import DraftInputs, MtpDrafter, make_mtp_drafter
from fastdeploy_r3.worker.routing_capture import RoutingCapture
from fastdeploy_r3.worker.routing_writer import RoutingWriter, make_routing_writer
from fastdeploy_r3.worker.sample.sampler import PendingSample, StepSampler
from fastdeploy_r3.worker.weight_loading import ControlMessage, ControlResult

logger = logging.getLogger(__name__)


class MissingSampledTokenError(RuntimeError):
    """A step scheduled ahead feeds a token its previous step did not sample (that step failed)."""


@dataclass
class LaunchedStep:
    """A step launched on the device and not yet finished (ModelRunner.launch / finish)."""

    out: StepOutput  # its tokens and logprobs are filled in by finish()
    pending: PendingSample | None = None  # rank 0's draw on its way to the host
    sample_rows: list[SampleRow] = field(default_factory=list)
    fed_from: int | None = None  # the step whose sampled ids filled this one's placeholders
    draft_inputs: DraftInputs | None = None  # MTP drafts: what the draft layer reads after the draw

    def done(self) -> bool:
        """Whether finish() would not wait."""
        return self.pending is None or self.pending.done()


class ModelRunner:
    # positions past a sampling chunk that one step feeds (WorkerReady.num_lookahead_tokens): none, since
    # this runner samples one token per request per step; a runner that verifies drafts feeds its drafts
    num_lookahead_tokens = 0

    def __init__(self, config: EngineConfig, rank: int, world_size: int, engine_suffix: str) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.engine_suffix = engine_suffix
        self.device = torch.device("cuda", cuda_index(rank)) if config.device == "cuda" else torch.device("cpu")
        self.dtype = torch_dtype(config.model_config.dtype)
        self.kv_dtype = torch_dtype(config.cache_config.kv_cache_dtype)  # the model dtype today (config/engine.py)
        self.block_size = config.cache_config.block_size
        if config.speculative_config is not None:  # a verify step feeds up to k drafts past its chunk
            self.num_lookahead_tokens = config.speculative_config.num_speculative_tokens
        self.with_draft_layer = config.speculative_config is not None and config.speculative_config.method == "mtp"
        self.drafter: MtpDrafter | None = None  # MTP drafts (worker/mtp_drafter.py), once the KV cache exists
        self.model: torch.nn.Module | None = None
        self.kv_cache: torch.Tensor | None = None  # [num_layers, 2, NB, BS, KVH, D]
        self._kv_segment: ShmSegment | None = None
        self.routing_host: RoutingBuffer | None = None
        self.routing_writer: RoutingWriter | None = None  # rank 0 only: writes into routing_host
        self.routing_capture: RoutingCapture | None = None
        self.decode_graphs: DecodeGraphs | None = None  # CUDA, graph-safe attention, not enforce_eager
        self.input_batcher = InputBatcher(self.block_size, self.device)
        self.sampler = StepSampler(config.model_config.vocab_size, self.device)
        self.weight_updater = None  # WeightUpdater, once the model is loaded
        self.memory = None  # MemoryOccupation, once the model is loaded
        # the previous step's sampled ids on the device and, by request, the row of its last one
        self._prev_ids: torch.Tensor | None = None  # [S] the previous step's sampled ids, on the device
        self._failed_steps: deque[int] = deque(maxlen=8)  # steps that failed in finish(), after launching

    # -- start-up -----------------------------------------------------------------------------------

    def load_model(self) -> None:
        from fastdeploy_r3.model_executor.model_loader import expert_placement_for, load_model
        from fastdeploy_r3.worker.memory_occupation import MemoryOccupation
        from fastdeploy_r3.worker.weight_updater import WeightUpdater

        torch.manual_seed(self.config.model_config.seed)
        mc = self.config.model_config
        placement = expert_placement_for(self.config.parallel_config, mc, self.rank)  # None: no expert parallel
        self.model = load_model(mc, self.device, self.rank, self.world_size, placement, self.with_draft_layer)
        if self.config.parallel_config.moe_a2a_backend != "local":
            from fastdeploy_r3.model_executor.layers.expert_alltoall import use_moe_a2a_backend

            use_moe_a2a_backend(self.model, self.config.parallel_config.moe_a2a_backend)
        # each blocking step of a weight update ends before the engine's stall watchdog would fire
        self.weight_updater = WeightUpdater(self.model, self.device, self.rank, self.dtype,
                                            deadline_s=self.config.parallel_config.worker_step_timeout_s)
        self.memory = MemoryOccupation(self)

    def control(self, msg: ControlMessage) -> ControlResult:
        """Run one control command between steps. Whatever goes wrong comes back as the result's error
        (the worker lives on with the weights it has), in words without paths, content or tracebacks."""
        from fastdeploy_r3.worker.weight_loading import run_control

        return run_control(self, msg)

    def kv_bytes_per_block(self) -> int:
        m = self.model
        assert m is not None
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return (m.num_layers + self.with_draft_layer) * 2 * self.block_size * m.num_kv_heads * m.head_dim * elem

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
        sc, mc = self.config.scheduler_config, self.config.model_config
        cap = usable_blocks(sc.max_num_seqs, mc.max_model_len, self.block_size)
        n = num_kv_blocks(budget, per_block, cap)
        if n == cap:
            logger.info("KV cache: %d blocks, capped at what %d sequences of %s tokens can use (memory holds %d)",
                        n, sc.max_num_seqs, mc.max_model_len, int(budget // per_block))
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
        if self.with_draft_layer:
            self.drafter = make_mtp_drafter(m, self.num_lookahead_tokens, self.block_size, num_gpu_blocks,
                                            self.config.scheduler_config.max_num_seqs, self.kv_dtype, self.device)
        dtype_name = self.config.cache_config.kv_cache_dtype  # a dtype name: EngineConfig resolved 'auto'
        name = shm_name(self.engine_suffix, f"kv_rank{self.rank}")
        if self.device.type == "cuda":
            # On GPU the cache lives in device memory; the CTM maps it through a CUDA IPC handle, valid
            # while self.kv_cache lives (until close()).
            from torch.multiprocessing.reductions import reduce_tensor

            self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            # Export a handle only for a CTM to map: an exported tensor nobody imports makes torch warn
            # at exit that the producer died before its consumers released it.
            ipc = reduce_tensor(self.kv_cache) if self.config.cache_config.uses_transfer_manager else None
            return KVCacheSpec(name, shape, dtype_name, device="cuda", cuda_ipc=ipc)
        else:
            nbytes = int(np.prod(shape)) * torch.tensor([], dtype=self.kv_dtype).element_size()
            if nbytes > shm_free_bytes():
                raise RuntimeError(
                    f"/dev/shm has {shm_free_bytes() / 2**20:.0f} MiB free, the KV cache needs "
                    f"{nbytes / 2**20:.0f} MiB; lower num_gpu_blocks_override / kv_cache_space_gib"
                )
            self._kv_segment = ShmSegment.create(name, nbytes)
            self.kv_cache = self._kv_segment.torch(shape, self.kv_dtype)
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

    def capture_decode_graphs(self, verify_query_len: int | None = None) -> None:
        """CUDA: record the decode graphs at start-up, after attach_routing (they bake in its capture), and
        the verify graphs of query length k + 1 under speculative decoding (verify_query_len overrides)."""
        if self.device.type != "cuda" or self.config.model_config.enforce_eager or self.model is None:
            return
        if self.config.parallel_config.moe_a2a_backend == "alltoall":  # its row counts sync with the host
            logger.info("decode runs eagerly: the all-to-all expert dispatch (layers/expert_alltoall.py) is not "
                        "CUDA-graph safe; the local one is (fixed-shape rows on CUDA, layers/expert_dispatch.py)")
            return
        if not attention_is_graph_safe(self.model):
            logger.info("decode runs eagerly: the attention backend is not CUDA-graph safe")
            return
        assert self.kv_cache is not None and self.config.model_config.max_model_len is not None
        self.decode_graphs = None  # a re-capture frees the old graphs' pool first
        graphs = DecodeGraphs(
            self.model, self._kv_caches(), self.routing_capture, self.config.scheduler_config.max_num_seqs,
            self.config.model_config.max_model_len, self.block_size, self.device,
            verify_query_len or self.num_lookahead_tokens + 1,
        )  # fmt: skip
        graphs.capture()
        self.decode_graphs = graphs

    def _kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert self.kv_cache is not None
        return [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(self.kv_cache.shape[0])]

    # -- steps --------------------------------------------------------------------------------------

    def _feed_previous_samples(
        self, step: StepInput, inp: StepInputs, prev_ids: torch.Tensor | None) -> None:
        """Fill the placeholder rows of a step scheduled ahead (engine/overlap.py) with the ids this worker
        sampled for their requests in its previous step, on the device: no round trip through the engine."""
        # only from the step just before, by id: any failure in between (even one raised before this
        # runner's execute, by a subclass) leaves older step ids in the batch state
        src = self.input_batcher.state.previous_samples(step.step_id, inp.state_rows[inp.placeholder_requests])
        if prev_ids is None or src.min() < 0 or step.step_id - 1 in self._failed_steps:
            missing = [step.requests[b].request_id for b, s in zip(inp.placeholder_requests.tolist(), src) if s < 0]
            # the previous step failed (or never sampled these): the engine discards this step and re-runs
            raise MissingSampledTokenError(
                f"step {step.step_id} feeds the token sampled by the previous step for request(s) "
                f"{', '.join(missing) or 'all'}, but that step sampled none for them; the engine re-sends the ids")
        rows = torch.from_numpy(inp.placeholder_rows).to(self.device, non_blocking=True)
        inp.input_ids[rows] = prev_ids[torch.from_numpy(src).to(self.device, non_blocking=True)]

    def execute(self, step: StepInput) -> StepOutput:
        """One step from inputs to sampled tokens: launch, then finish."""
        return self.finish(self.launch(step))

    @torch.inference_mode()
    def launch(self, step: StepInput) -> LaunchedStep:
        """Everything of a step up to the host wait: inputs, forward, R3 scatter, the draw. The worker
        (worker_process.py) may launch the next step before finishing this one; whatever the next step
        reads from this one (the sampled ids, the penalty counts) is on the device already."""
        for rid in step.finished_request_ids:
            self.sampler.forget(rid)
            self.input_batcher.forget(rid)
            if self.drafter is not None:
                self.drafter.forget(rid)
        # whatever this step does, a later step may feed only what it samples (a failed step: nothing)
        prev_ids, self._prev_ids = self._prev_ids, None
        launched = LaunchedStep(StepOutput(step.step_id, {}))
        if not step.requests:
            return launched
        model = self.model
        assert model is not None and self.kv_cache is not None
        bs = self.block_size

        inp = self.input_batcher.prepare(step.requests)
        if len(inp.placeholder_rows):
            self._feed_previous_samples(step, inp, prev_ids)
            launched.fed_from = step.step_id - 1
        for r in step.requests:
            self.sampler.remember(r)
        slot_t, pos_t = inp.slot_mapping, inp.positions  # [T], [T]
        meta = AttentionMetadata(
            slot_mapping=slot_t,
            query_start_loc=inp.query_start_loc,
            query_lens=inp.query_lens,
            seq_lens=inp.seq_lens,
            block_tables=inp.block_tables,
            block_size=bs,
            seq_lens_tensor=inp.seq_lens_tensor,
            query_start_loc_tensor=inp.query_start_loc_tensor,
        )
        capture = self.routing_capture
        if capture is not None:
            capture.begin_step(inp.num_tokens, pos_t)
        graphs = self.decode_graphs
        logits = hidden = None
        q = graphs.query_len_for(step.requests, inp.block_tables.shape[1]) if graphs is not None else None
        if q is not None:
            if capture is not None:
                capture.mark_graph_replay()  # the graph's capture kernels write the step buffer
            logits = graphs.replay(inp, q)  # [S, V]: a decode or verify step, every token samples
            if self.drafter is not None:  # MTP drafts read every token's hidden state
                launched.draft_inputs = DraftInputs(graphs.hidden_of(), step.requests, inp.query_start_loc)
        else:  # (the per-layer views cost ~0.5 ms of host time on the H200's host: eager steps only)
            with set_forward_context(ForwardContext(meta, self._kv_caches(), capture)):
                hidden = model(inp.input_ids, pos_t)  # [T, H]

        if capture is not None:
            capture.check_complete()
            if self.routing_writer is not None:
                # when this rank samples, the wait for the sampled ids (finish) comes after the scatter on
                # the same stream: the rows are in place before any token is published
                samples_here = bool(inp.sample_rows) and self.rank == 0
                rows = self.routing_writer.rows_of(capture, inp.num_tokens)  # [T, L, K]
                self.routing_writer.write(rows, slot_t, inp.tags, pos_t, synchronize=not samples_here)

        # every rank holds the same hidden states (all-reduced) and the engine reads rank 0's tokens only
        if self.rank == 0:
            if inp.sample_rows:
                if logits is None:
                    logits = model.compute_logits(hidden[inp.sample_idx])  # [S, V] float32
                launched.pending = self.sampler.sample_async(logits, inp.sample_rows)
                launched.sample_rows = inp.sample_rows
                assert self.sampler.last_ids is not None
                self._prev_ids = self.sampler.last_ids
                self.input_batcher.state.record_samples(step.step_id, inp.state_rows[inp.sample_requests])
            if self.drafter is not None and hidden is not None:  # eager (a replayed graph set them above)
                launched.draft_inputs = DraftInputs(hidden, step.requests, inp.query_start_loc)
            if hidden is not None:  # a replayed decode graph feeds no prompt position
                chunk_rows = [(inp.query_start_loc[b], r) for b, r in enumerate(step.requests)]
                launched.out.prompt_logprobs = self.sampler.prompt_logprobs(model.compute_logits, hidden, chunk_rows)
        return launched

    @torch.inference_mode()  # a failed step's penalty counts (inference tensors) are taken back here
    def finish(self, launched: LaunchedStep) -> StepOutput:
        """Wait for a launched step's draw and hand its tokens over. A step fed by a step that failed
        in its own finish (after this one was launched) fails too: the engine re-sends its ids."""
        out = launched.out
        try:
            if launched.fed_from is not None and launched.fed_from in self._failed_steps:
                raise MissingSampledTokenError(
                    f"step {out.step_id} was fed the tokens step {launched.fed_from} sampled, and that step "
                    "failed after all; the engine re-sends the ids")
            if launched.pending is None:
                return out
            ids, records = launched.pending.wait()
        except Exception:
            self._fail(launched)
            raise
        verified: set[str] = set()  # requests whose verification ended: their later rows are dropped
        for i, (row, tok) in enumerate(zip(launched.sample_rows, ids)):  # rows of a request are in order
            rid = row.request.request_id
            if rid in verified:
                continue
            out.sampled_token_ids.setdefault(rid, []).append(tok)
            if i in records:
                out.logprobs.setdefault(rid, []).append(records[i])
            # a verify step (engine/speculative.py): the row keeps going while its token is the draft fed
            # at the next position, since the next row's logits were computed after that draft; the
            # first other token (or the row after the last draft: the bonus) ends the request's list
            r, at = row.request, row.position - row.request.start_pos
            if at >= len(r.token_ids) or r.token_ids[at] != tok:
                verified.add(rid)
        if launched.draft_inputs is not None and self.drafter is not None:  # after the draw: drafts follow it
            out.draft_token_ids = self.drafter.propose(launched.draft_inputs, out.sampled_token_ids)
        return out

    def _fail(self, launched: LaunchedStep) -> None:
        """A launched step failed in finish: no later step may feed what it sampled."""
        if launched.pending is not None:
            launched.pending.discard()  # once: a wait() that raised may have discarded already
        self._failed_steps.append(launched.out.step_id)
        if self._prev_ids is not None and launched.pending is not None and self._prev_ids is launched.pending.ids:
            self._prev_ids = None

    def close(self) -> None:
        self.decode_graphs = None  # before the KV cache and capture buffer its graphs point into
        if self.weight_updater is not None:
            self.weight_updater.close()
            self.weight_updater = None
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

