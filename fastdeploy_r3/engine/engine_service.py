"""The engine: owns the scheduler and the cache tiers, drives the workers step by step, and starts
and supervises its children (workers, CacheTransferManager).

    EngineService
      ├─ Scheduler ── PrefixCacheManager (GPU pool, CPU tier, storage lookups)
      ├─ routing_host_buffer (SHM, created here once the KV cache is sized)
      ├─ TokenProcessor ── RoutingCacheManager (gather at finish)
      ├─ worker processes (one per TP rank)
      └─ CacheTransferManager process (when a CPU tier or a storage tier is configured)
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from dataclasses import dataclass, field, fields, replace

from fastdeploy_r3.cache_manager.block_hash import root_hash
from fastdeploy_r3.cache_manager.prefix_cache_manager import PrefixCacheManager
from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer, RoutingBufferSpec
from fastdeploy_r3.cache_manager.shm import new_engine_suffix, remove_stale_segments, shm_name, unlink_all
from fastdeploy_r3.cache_manager.storage_lookup import StorageLookup
from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.engine.request import Request, RequestStatus
from fastdeploy_r3.engine.scheduler import QueueFullError, ScheduledChunk, Scheduler, SchedulerOutput
from fastdeploy_r3.engine.step_isolation import StepAttempt, run_isolating_failures
from fastdeploy_r3.engine.token_processor import TokenProcessor
from fastdeploy_r3.engine.transfer_supervisor import TransferSupervisor
from fastdeploy_r3.engine.worker_group import WorkerGroup
from fastdeploy_r3.lifecycle import EngineDeadError
from fastdeploy_r3.outputs import CompletionDelta, RequestDelta, weight_version_spans
from fastdeploy_r3.r3.layouts import row_range
from fastdeploy_r3.sampling_params import InvalidRequestError, SamplingParams
from fastdeploy_r3.worker.messages import (
    AttachRoutingBuffer,
    ScheduledRequestData,
    StepInput,
    WorkerReady,
)

logger = logging.getLogger(__name__)

@dataclass
class _Group:
    """A user request: one child Request per choice (n > 1)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request] = field(default_factory=list)
    announced: bool = False  # its first delta (with the prompt) went out


class EngineService:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.suffix = new_engine_suffix()
        self._closed = False
        self._dead: str | None = None
        self.workers: WorkerGroup | None = None
        self._transfers: TransferSupervisor | None = None  # the cache transfer manager, over its life
        self._lookup: StorageLookup | None = None
        self._routing_host: RoutingBuffer | None = None
        self._step_id = 0
        self._groups: dict[str, _Group] = {}
        self._child_group: dict[str, str] = {}  # child request id -> user request id
        self._worker_known: set[str] = set()
        self._finished_since_step: list[str] = []
        self._pending_outputs: list[str] = []
        _live_engines.add(self)
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    # -- start-up -----------------------------------------------------------------------------------

    def _start(self) -> None:
        for name in remove_stale_segments():
            logger.warning("removed shared memory %s left by an engine that is gone", name)
        cfg = self.config
        mc, cc, sc, rr = cfg.model_config, cfg.cache_config, cfg.scheduler_config, cfg.routing_replay_config
        try:
            from fastdeploy_r3.engine.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(mc.model)
        except Exception as e:  # token-id-only models are served too
            logger.warning("no tokenizer loaded (%s); only token-id prompts are accepted", e)
            self.tokenizer = None
        # as vLLM: the tokenizer's eos stops generation too, besides config.json's and generation_config.json's
        eos = list(dict.fromkeys([*mc.eos_token_ids, *(self.tokenizer.eos_token_ids if self.tokenizer else [])]))
        ignored = sorted(set(mc.generation_defaults) - {f.name for f in fields(SamplingParams)})
        if ignored:
            logger.warning("generation_config.json sets %s, which this engine does not implement; requests are "
                           "sampled without it", ", ".join(f"{k}={mc.generation_defaults[k]}" for k in ignored))

        self.workers = WorkerGroup(cfg, self.suffix)
        readies: list[WorkerReady] = self.workers.collect(timeout=600)
        num_gpu_blocks = min(r.num_gpu_blocks for r in readies)
        self.num_gpu_blocks = num_gpu_blocks
        capacity = num_gpu_blocks * cc.block_size
        if capacity < cfg.max_model_len:
            # A longer sequence could never fit even alone (preemption cannot help it), so the
            # engine's own limit, and the server's default max_tokens, follow the cache.
            logger.warning("max_model_len %d lowered to %d, what %d KV blocks of %d tokens hold",
                           cfg.max_model_len, capacity, num_gpu_blocks, cc.block_size)
            mc.max_model_len = capacity

        routing_spec = None
        if rr.enable_routing_replay:
            routing_spec = RoutingBufferSpec(
                name=shm_name(self.suffix, "routing_host"),
                num_slots=num_gpu_blocks * cc.block_size,
                num_layers=rr.num_moe_layers,
                top_k=rr.moe_top_k,
                dtype=rr.routing_dtype.name,  # type: ignore[union-attr]
            )
            self._routing_host = RoutingBuffer.create(routing_spec)
        self.workers.call(AttachRoutingBuffer(routing_spec), timeout=120)

        num_cpu_blocks = 0
        if cc.enable_prefix_caching and cc.has_cpu_tier:
            num_cpu_blocks = (  # swap_space is per worker rank, as in vLLM
                cc.num_cpu_blocks_override
                if cc.num_cpu_blocks_override is not None
                else int(cc.swap_space * 2**30 // readies[0].kv_spec.block_nbytes)
            )
        storage = None
        namespace = f"{mc.model_identity}|{mc.weight_version}"
        if cc.enable_prefix_caching and cc.kv_storage:
            from fastdeploy_r3.blobstore import open_blob_store

            storage = open_blob_store(cc.kv_storage, namespace, cc.storage_timeout_s, ttl_s=cc.kv_storage_ttl_s,
                                           lookup_only=True)  # the CTM writes
            self._lookup = StorageLookup(storage, cc.storage_timeout_s, storage.health)
        transfer = None
        if num_cpu_blocks > 0 or storage is not None:
            from fastdeploy_r3.cache_manager.transfer import CacheTransferConfig

            self._transfers = TransferSupervisor(CacheTransferConfig(
                kv_specs=[r.kv_spec for r in readies],
                num_cpu_blocks=num_cpu_blocks,
                block_size=cc.block_size,
                routing_host=routing_spec,
                routing_swap_name=shm_name(self.suffix, "routing_swap") if routing_spec else None,
                kv_cpu_name=shm_name(self.suffix, "kv_cpu"),
                storage_url=cc.kv_storage if storage is not None else None,
                storage_namespace=namespace,
                parent_pid=os.getpid(),
                storage_timeout_s=cc.storage_timeout_s,
                storage_ttl_s=cc.kv_storage_ttl_s,
                storage_capacity_bytes=(None if cc.kv_storage_capacity_gib is None
                                        else int(cc.kv_storage_capacity_gib * 2**30)),
            ))
            transfer = self._transfers.start()
        self.num_cpu_blocks = num_cpu_blocks
        self.kv = PrefixCacheManager(
            num_gpu_blocks=num_gpu_blocks,
            block_size=cc.block_size,
            enable_prefix_caching=cc.enable_prefix_caching,
            root_hash=root_hash(mc.model_identity, mc.weight_version),
            num_cpu_blocks=num_cpu_blocks,
            transfer=transfer,
            lookup=self._lookup,
            transfer_timeout_s=cc.transfer_timeout_s,
        )
        self.scheduler = Scheduler(self.kv, sc.max_num_seqs, sc.max_num_batched_tokens, sc.enable_chunked_prefill,
                                   max_waiting=sc.max_waiting_requests)
        routing = None
        if self._routing_host is not None:
            from fastdeploy_r3.cache_manager.routing_cache_manager import RoutingCacheManager

            routing = RoutingCacheManager(
                self._routing_host, cc.block_size, num_experts=rr.num_experts, debug_mode=rr.debug_mode
            )
        self.token_processor = TokenProcessor(self.scheduler, self.tokenizer, eos, cfg.max_model_len, routing)
        from fastdeploy_r3.engine.control import EngineControl

        self.control = EngineControl(self)

    # -- requests -----------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> None:
        self._check_alive()
        self.control.check_weights_usable()
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        if request_id in self._groups or any(rid in self._child_group for rid in child_ids):
            raise InvalidRequestError(f"request id {request_id!r} is already in flight; use a unique id")
        self._validate_prompt(prompt_token_ids, params)
        if not self.scheduler.can_accept(params.n):
            raise QueueFullError(
                f"{len(self.scheduler.waiting)} requests are waiting, the bound is "
                f"{self.scheduler.max_waiting}; retry later"
            )
        group = _Group(request_id, prompt, list(prompt_token_ids))
        for i, rid in enumerate(child_ids):
            child_params = params
            if params.n > 1:
                # every choice scores the same prompt: the first one alone computes its logprobs
                child_params = replace(params, n=1, seed=params.choice_seed(i),
                                       prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            req = Request(rid, list(prompt_token_ids), child_params, weight_version=self.weight_version)
            group.children.append(req)
            self._child_group[rid] = request_id
            self.scheduler.add_request(req)
        self._groups[request_id] = group

    def _validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        max_len = self.config.max_model_len
        if not ids:
            raise InvalidRequestError("the prompt is empty; send at least one token")
        if len(ids) >= max_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens but max_model_len is {max_len}; shorten the prompt to at "
                f"most {max_len - 1} tokens or start the engine with a larger --max-model-len"
            )
        vocab = self.config.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if params.routed_experts_start > len(ids) - 1:
            # rows are [start, P + N - 1): a start past the prompt's last row would skip rows the
            # trainer did not have, or ask for rows that may never exist; refused, never clamped
            raise InvalidRequestError(
                f"routed_experts_start={params.routed_experts_start} but the prompt has {len(ids)} tokens, so "
                f"its rows end at {len(ids) - 1}; use at most {len(ids) - 1} (the rows a trainer already has "
                "of an earlier turn are fewer than this turn's prompt tokens)"
            )

    def abort_request(self, request_id: str, message: str | None = None) -> None:
        group = self._groups.get(request_id)
        if group is None:
            return
        for req in group.children:
            if not req.is_finished:
                req.finish_message = message
                self.token_processor.finish(req, RequestStatus.FINISHED_ABORTED)
                self._finished_since_step.append(req.request_id)
        self._pending_outputs.append(request_id)

    def unfinished_requests(self) -> list[Request]:
        return [req for group in self._groups.values() for req in group.children if not req.is_finished]

    def request_ids(self) -> list[str]:
        return list(self._groups)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def has_work(self) -> bool:
        """A step would do something: outputs to send, or requests to advance and no pause."""
        return bool(self._pending_outputs) or (bool(self._groups) and self.control.paused is None)

    @property
    def weight_version(self) -> str:
        return self.config.model_config.weight_version

    # -- the step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        self._check_alive()
        touched: set[str] = set(self._pending_outputs)
        self._pending_outputs.clear()
        try:
            self._check_children()
            self.kv.poll_transfers()
            if self._transfers is not None:
                self._transfers.tick(self.kv)  # a lost CTM is replaced without the loop waiting for it
            # paused: nothing advances (in_place requests keep their blocks); aborts still go out
            out = self.scheduler.schedule() if self.control.paused is None else SchedulerOutput()
            if not out.chunks and self._lookup is not None and self.kv.has_pending_lookups():
                self._lookup.wait(0.01)  # nothing to run but lookups: do not spin
            if out.chunks:
                # a failed step is bisected so that only the requests that make it fail fail
                step = run_isolating_failures(out.chunks, self._run_batch)
                for chunk, error in step.failed:
                    # nothing of a failed chunk is trusted: its cursor stays, its blocks are not cached
                    rid = chunk.request.request_id
                    logger.error("request %s failed the model step on its own: %s", rid, error)
                    self.token_processor.finish(chunk.request, RequestStatus.FINISHED_ERROR, error=(
                        f"the model step failed on this request alone ({error.split(':', 1)[0]}); the other "
                        "requests of the step were served; the engine log has the details"))
                served = [c for c in out.chunks if not c.request.is_finished]
                self.scheduler.update_after_step(replace(out, chunks=served))
                scheduled = {c.request.request_id: c.request for c in served}
                for rid, (first, records) in step.prompt_logprobs.items():
                    if rid in scheduled:
                        scheduled[rid].add_prompt_logprobs(first, records)
                for chunk in served:
                    if chunk.samples:
                        rid = chunk.request.request_id
                        self.token_processor.append_token(chunk.request, step.sampled[rid], step.logprobs.get(rid))
                for chunk in out.chunks:
                    req = chunk.request
                    touched.add(self._child_group[req.request_id])
                    if req.is_finished:
                        self._finished_since_step.append(req.request_id)
        except Exception as e:
            self._die(f"{type(e).__name__}: {e}")
            raise EngineDeadError(self._dead) from e
        return self._collect(touched)

    def _run_batch(self, chunks: list[ScheduledChunk], retry: bool) -> StepAttempt:
        """One worker step over `chunks`. A retry (a part of a failed step, re-run) sends every
        request's sampling params again, since the failed step may have ended before the workers
        took them, and no finished ids, which the first attempt delivered."""
        self._step_id += 1
        reqs = []
        for chunk in chunks:
            r = chunk.request
            start = chunk.start
            first = retry or r.request_id not in self._worker_known
            self._worker_known.add(r.request_id)
            reqs.append(
                ScheduledRequestData(
                    request_id=r.request_id,
                    token_ids=r.all_token_ids[start : start + chunk.num_new_tokens],
                    start_pos=start,
                    block_table=self.kv.block_table(r.request_id),
                    block_tags=self.kv.block_tags(r.request_id),
                    sample=chunk.samples,
                    sampling_params=r.sampling_params if first else None,
                    sampling_seed=r.sampling_params.seed if first else None,
                )
            )
            if first:
                self._first_chunk_extras(reqs[-1], r)
        finished: list[str] = []
        if not retry:
            finished = [rid for rid in self._finished_since_step if rid in self._worker_known]
            self._worker_known.difference_update(finished)
            self._finished_since_step.clear()
        assert self.workers is not None
        outs = self.workers.call(StepInput(self._step_id, reqs, finished),
                                 timeout=self.config.parallel_config.worker_step_timeout_s)
        errors = [o.error for o in outs if o.error]
        if errors:
            return StepAttempt(error=errors[0])
        o = outs[0]
        return StepAttempt(sampled=o.sampled_token_ids, logprobs=o.logprobs, prompt_logprobs=o.prompt_logprobs)

    def _first_chunk_extras(self, data: ScheduledRequestData, r: Request) -> None:
        """What the worker's StepSampler needs beyond the chunk, sent once (worker/messages.py)."""
        p = r.sampling_params
        data.num_prompt_tokens = r.num_prompt_tokens
        if p.has_penalties or p.prompt_logprobs is not None:
            data.prompt_token_ids = r.prompt_token_ids
        if p.min_tokens > 0:
            eos = [] if p.ignore_eos else sorted(self.token_processor.eos_token_ids)
            data.min_tokens_stop_ids = sorted(set(eos) | set(p.stop_token_ids))

    def _collect(self, group_ids: set[str]) -> list[RequestDelta]:
        deltas = []
        for gid in sorted(group_ids):
            group = self._groups.get(gid)
            if group is None:
                continue
            delta = self._make_delta(group)
            deltas.append(delta)
            if delta.finished:
                del self._groups[gid]
                for req in group.children:
                    self._child_group.pop(req.request_id, None)
        return deltas

    def _make_delta(self, group: _Group) -> RequestDelta:
        """What is new for this request since its previous delta; the prompt goes with the first one."""
        rr = self.config.routing_replay_config
        comps = []
        for i, req in enumerate(group.children):
            if req.delta_finished:
                continue  # its finishing delta went out already
            sent = req.num_sent_tokens
            text, token_ids = self.token_processor.take_delta(req)
            logprobs = None if req.output_logprobs is None else req.output_logprobs[sent : sent + len(token_ids)]
            finish_reason = None
            if req.is_finished:
                finish_reason, req.delta_finished = req.status.value, True
            comps.append(
                CompletionDelta(
                    index=i,
                    text=text,
                    token_ids=token_ids,
                    finish_reason=finish_reason,
                    stop_reason=req.stop_reason,
                    routed_experts=req.routed_experts if req.is_finished else None,
                    routed_experts_start=row_range(req.num_prompt_tokens, req.num_sent_tokens,
                                                   req.sampling_params.routed_experts_start)[0],
                    error=req.error,
                    logprobs=logprobs,
                    finish_message=req.finish_message,
                    weight_versions=weight_version_spans(
                        [(e.version, e.num_output_tokens) for e in req.weight_version_events], req.weight_version,
                        req.num_sent_tokens,
                    ),
                    spans_weight_versions=req.spans_weight_versions,
                )
            )
        delta = RequestDelta(
            request_id=group.request_id,
            outputs=comps,
            finished=all(r.is_finished for r in group.children),
            num_cached_tokens=max(group.children[0].num_cached_tokens, 0),
        )
        first_child = group.children[0]  # every choice scores the same prompt: send the first one's
        if first_child.prompt_logprobs is not None and not first_child.prompt_logprobs_sent and (
            not first_child.needs_prompt_logprobs or first_child.is_finished
        ):
            first_child.prompt_logprobs_sent = True
            delta.prompt_logprobs = list(first_child.prompt_logprobs)
        if not group.announced:
            group.announced = True
            delta.prompt, delta.prompt_token_ids = group.prompt, group.prompt_token_ids
            delta.moe_layer_ids = list(rr.moe_layer_ids or []) if rr.enable_routing_replay else None
        return delta

    # -- supervision --------------------------------------------------------------------------------

    def _check_children(self) -> None:
        if self.workers is not None:
            self.workers.check_alive()

    def degraded(self) -> dict[str, str]:
        """What works less well than configured, for /health: {"kv_storage": why, "cache_transfer": why}."""
        out = {}
        if self._lookup is not None and (why := self._lookup.health.degraded) is not None:
            out["kv_storage"] = why
        if self._transfers is not None and self._transfers.failed is not None:
            out["cache_transfer"] = self._transfers.failed
        return out

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._closed:
            raise EngineDeadError("the engine was shut down")

    def _die(self, reason: str) -> None:
        """Fail every in-flight request with the reason and stop the children."""
        self._dead = f"engine failed: {reason}"
        logger.error(self._dead)
        for group in self._groups.values():
            for req in group.children:
                if not req.is_finished:
                    req.status = RequestStatus.FINISHED_ERROR
                    req.error = self._dead
                    req.routed_experts = None
            self._pending_outputs.append(group.request_id)
        self._stop_children()

    def fail_all(self) -> list[RequestDelta]:
        """Outputs of the requests failed by a dead engine (call after EngineDeadError)."""
        outs = self._collect(set(self._pending_outputs))
        self._pending_outputs.clear()
        return outs

    def metrics(self) -> dict[str, float]:
        c = self.kv.counters
        r3 = self.token_processor.r3
        return {
            "num_gpu_blocks": self.num_gpu_blocks,
            "num_cpu_blocks": self.num_cpu_blocks,
            "num_free_gpu_blocks": self.kv.gpu.num_free_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "prefix_hit_blocks": c.gpu_hit_blocks,
            "swap_out_blocks": c.swap_out_blocks,
            "swap_in_blocks": c.swap_in_blocks,
            "storage_load_blocks": c.storage_load_blocks,
            "storage_load_failed_blocks": c.storage_load_failed_blocks,
            "storage_put_blocks": c.storage_put_blocks,
            "cache_transfer_replacements": 0 if self._transfers is None else self._transfers.replacements,
            "kv_storage_lookup_failures": 0 if self._lookup is None else self._lookup.health.counters.failures,
            **(self._transfers.store_counters if self._transfers is not None else {}),
            "evicted_blocks": c.evicted_blocks,
            "preemptions": self.scheduler.num_preemptions,
            "weight_updates": self.control.num_weight_updates,
            "r3_rows_delivered": r3.rows_delivered,
            "r3_bytes": r3.bytes_delivered,
            "r3_failures": r3.failures,
            "r3_gather_seconds": r3.gather_seconds,
        }

    def _stop_children(self) -> None:
        # The CTM first: on CUDA it maps the workers' KV through IPC handles, which must be released
        # before the worker that exported them exits.
        if self._transfers is not None:
            self._transfers.stop()
        if self.workers is not None:
            self.workers.stop()
        if self._routing_host is not None:
            self._routing_host.close()
            self._routing_host = None
        unlink_all(self.suffix)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._lookup is not None:
            self._lookup.close()
        if self._dead is None and hasattr(self, "kv"):
            try:
                self.kv.poll_transfers(block=True)
            except Exception:
                logger.exception("waiting for write-through")
        self._stop_children()
        if hasattr(self, "kv") and self.kv.storage is not None:
            self.kv.storage.close()  # a Mooncake client takes the objects of its segment with it
        _live_engines.discard(self)


_live_engines: weakref.WeakSet[EngineService] = weakref.WeakSet()


@atexit.register
def _shutdown_live_engines() -> None:
    for eng in list(_live_engines):
        try:
            eng.shutdown()
        except Exception:
            pass
