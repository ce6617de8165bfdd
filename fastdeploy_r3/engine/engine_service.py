"""The engine loop: add / abort requests, step, metrics, shutdown. It owns the parts that builder.py
starts and supervises its children (workers, CacheTransferManager).

    EngineService
      ├─ EngineParts (builder.py): workers, routing_host_buffer, KV stores, CTM,
      │                            Scheduler ── PrefixCacheManager, TokenProcessor ── RoutingCacheManager
      ├─ RequestGroups (request_groups.py): n>1 fan-out, deltas
      ├─ StepBuilder (step_builder.py): what the workers are sent
      └─ EngineControl (control.py): pause, flush, weight updates

One step:  schedule ─► send to the workers ─► [overlap.py: plan and send the next step ahead] ─► collect
           (a failure bisected: step_isolation.py) ─► advance cursors ─► append each request's sampled
           tokens (TokenProcessor: stops, R3 at finish) ─► [send early: schedule and send the next step]
           ─► deltas
With overlap one step is in flight between calls of step(); every other worker call (control.py)
and retract_running first drain it (`drain`). Where no step can ever be planned ahead though overlap is
not disabled (speculative decoding, tensor parallelism: overlap.py), the next step is scheduled and
sent as soon as this one's tokens are applied, exactly as the next call would have scheduled it, and
this step's deltas are built (and sent by the engine loop) while the workers run it: `send_early`.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Callable
from dataclasses import replace

from fastdeploy_r3.cache_manager.shm import new_engine_suffix, remove_stale_segments
from fastdeploy_r3.cache_manager.transfer import RemoteBlocks
from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.engine.builder import EngineParts, build_engine
from fastdeploy_r3.engine.control import EngineControl
from fastdeploy_r3.engine.control_error import WeightVersionError
from fastdeploy_r3.engine.engine_metrics import engine_metrics
from fastdeploy_r3.engine.overlap import OverlapCounters, overlap_enabled, schedule_ahead
from fastdeploy_r3.engine.request import Request, RequestStatus
from fastdeploy_r3.engine.request_groups import RequestGroups, validate_prompt
from fastdeploy_r3.engine.scheduler import QueueFullError, ScheduledChunk, SchedulerOutput
from fastdeploy_r3.engine.speculative import Speculation
from fastdeploy_r3.engine.step_builder import StepBuilder
from fastdeploy_r3.engine.step_counters import StepCounters, Stopwatch
from fastdeploy_r3.engine.step_isolation import StepAttempt, run_isolating_failures
from fastdeploy_r3.lifecycle import EngineDeadError
from fastdeploy_r3.outputs import RequestDelta
from fastdeploy_r3.sampling_params import SamplingParams
from fastdeploy_r3.worker.messages import StepInput

logger = logging.getLogger(__name__)

_TIER_WAIT_S = 0.01  # an idle step waits this long at most for a load or lookup (new requests meanwhile wait)


class EngineService:
    def __init__(self, config: EngineConfig, runner_cls: type | None = None) -> None:
        """runner_cls: the workers' model runner (worker/model_runner.py's ModelRunner unless given)."""
        for name in remove_stale_segments():
            logger.warning("removed shared memory %s left by an engine that is gone", name)
        self.config = config
        self.suffix = new_engine_suffix()
        self._closed = False
        self._dead: str | None = None
        self.parts: EngineParts = build_engine(config, self.suffix, runner_cls)  # closes what it opened on failure
        p = self.parts
        rr = config.routing_replay_config
        moe_layer_ids = list(rr.moe_layer_ids or []) if rr.enable_routing_replay else None
        self.groups = RequestGroups(p.token_processor, moe_layer_ids)
        self.steps = StepBuilder(p.kv.blocks_since, p.token_processor.eos_token_ids)
        mc, has_tiers = config.model_config, config.cache_config.uses_transfer_manager
        from fastdeploy_r3.model_executor.model_loader import expert_placements_of_ranks

        placements = expert_placements_of_ranks(config.parallel_config, mc)  # None: no expert parallelism
        self.control = EngineControl(self, p.kv, _DrainFirst(self), mc.model_identity, mc.weight_version, has_tiers,
                                     placements)
        self._pending_outputs: list[str] = []  # user requests whose news go out with the next step
        self.overlap = overlap_enabled(config.scheduler_config.disable_overlap_schedule,
                                       config.parallel_config.tensor_parallel_size, p.scheduler.num_lookahead_tokens)
        # no step planned ahead, ever, though not disabled: each step is sent before the last one's outputs
        self.send_early = not self.overlap and not config.scheduler_config.disable_overlap_schedule
        self.overlap_counters = OverlapCounters()
        sp = config.speculative_config
        self.speculation = None if sp is None else Speculation(
            sp, config.scheduler_config.max_num_batched_tokens, p.scheduler.num_lookahead_tokens)
        self._in_flight: SchedulerOutput | None = None  # the step sent and not collected yet
        self.step_counters = StepCounters()  # where each step's wall time goes (/metrics)
        self._input_seconds = self._worker_seconds = 0.0  # building inputs / waiting for the workers, retries included
        _live_engines.add(self)

    # the parts most callers reach for
    kv = property(lambda self: self.parts.kv)
    scheduler = property(lambda self: self.parts.scheduler)
    token_processor = property(lambda self: self.parts.token_processor)
    tokenizer = property(lambda self: self.parts.tokenizer)
    workers = property(lambda self: self.parts.resources.workers)
    num_gpu_blocks = property(lambda self: self.parts.num_gpu_blocks)
    num_cpu_blocks = property(lambda self: self.parts.num_cpu_blocks)
    max_model_len = property(lambda self: self.parts.max_model_len)  # the config's, lowered to what the KV holds
    weight_version = property(lambda self: self.control.weight_version)  # EngineControl owns it

    # -- requests -----------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
        weight_version: str | None = None, remote_blocks: RemoteBlocks | None = None, keep_prompt_tail: bool = False,
        peer_prompt_tokens: int = 0,
    ) -> None:
        """Queue a request; weight_version, remote_blocks, keep_prompt_tail, peer_prompt_tokens: AddRequest's."""
        self._check_alive()
        self.control.check_weights_usable()
        if weight_version is not None and weight_version != self.weight_version:
            raise WeightVersionError(f"the request must run on weight_version {weight_version!r}, this engine "
                                     f"holds {self.weight_version!r}")
        validate_prompt(prompt_token_ids, params, self.parts.max_model_len, self.config.model_config.vocab_size)
        if not self.scheduler.can_accept(params.n):
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests are waiting, the bound is "
                                 f"{self.scheduler.max_waiting}; retry later")
        group = self.groups.fan_out(request_id, prompt_token_ids, params, prompt, self.weight_version)
        for req in group.children:
            if remote_blocks is not None:
                self.kv.expect_remote(req.request_id, remote_blocks)
            self.kv.keep_prompt_tail(req.request_id, len(prompt_token_ids) if keep_prompt_tail else 0)
            self.kv.expect_prompt_tail(req.request_id, peer_prompt_tokens)  # 0: none
            self.scheduler.add_request(req)

    def abort_request(self, request_id: str, message: str | None = None) -> None:
        group = self.groups.get(request_id)
        if group is None:
            return
        for req in group.children:
            if not req.is_finished:
                self.token_processor.finish(req, RequestStatus.FINISHED_ABORTED, message=message)
                self.steps.finished(req.request_id)
        self._pending_outputs.append(request_id)

    def unfinished_requests(self) -> list[Request]:
        return self.groups.unfinished_requests()

    def retract_running(self) -> None:
        self.drain()  # the step in flight writes the KV of the requests retracted
        self.scheduler.retract_running()

    def request_ids(self) -> list[str]:
        return self.groups.ids()

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def has_work(self) -> bool:
        """A step would do something: outputs to send, or requests to advance and no pause."""
        return (bool(self._pending_outputs) or self._in_flight is not None
                or (bool(self.groups) and self.control.paused is None))

    # -- the step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        self._check_alive()
        touched: set[str] = set(self._pending_outputs)
        self._pending_outputs.clear()
        res = self.parts.resources
        watch, input_before, worker_before = Stopwatch(), self._input_seconds, self._worker_seconds
        try:
            self.workers.check_alive()
            self.kv.poll_transfers()
            if res.transfers is not None:
                res.transfers.tick()  # a lost CTM is replaced without the loop waiting for it
            out, self._in_flight = self._in_flight, None
            if out is None:
                # paused: nothing advances (in_place requests keep their blocks); aborts still go out
                out = self.scheduler.schedule() if self.control.paused is None else SchedulerOutput()
                if out.chunks:
                    self._send(out)
                else:
                    self._wait_for_tiers()
            if out.chunks:
                if self.overlap and self.control.paused is None:
                    ahead = schedule_ahead(self.scheduler, out.chunks, self.parts.max_model_len)
                    if ahead is not None:  # the workers take it as soon as the step in flight is done
                        self.overlap_counters.overlapped_steps += 1
                        self.workers.broadcast(self._build(ahead.chunks, False))
                        self._in_flight = ahead
                # the step's parts (/metrics): scheduling (this one's and the one planned ahead or sent early),
                # inputs built, waiting for the workers, and the rest: applying tokens and building the deltas
                input_at_schedule = self._input_seconds - input_before
                schedule_s = watch.lap() - input_at_schedule
                touched |= self._finish_step(out)
                early_s = self._send_next() if self.send_early and self.control.paused is None else 0.0
                schedule_s += early_s
        except Exception as e:
            self._die(f"{type(e).__name__}: {e}")
            raise EngineDeadError(self._dead) from e
        deltas = self.groups.collect(touched)
        if out.chunks:
            input_s, worker_s = self._input_seconds - input_before, self._worker_seconds - worker_before
            output_s = watch.lap() - worker_s - (input_s - input_at_schedule) - early_s  # since the schedule's lap
            decode_only = all(c.num_new_tokens == 1 and c.samples for c in out.chunks)
            self.step_counters.add_step(schedule_s, input_s, worker_s, output_s, len(deltas), decode_only)
        return deltas

    def _send_next(self) -> float:
        """Schedule and send the next step now, before this one's deltas are built and sent (the loop's
        output work then runs beside the workers' step), when no step could be planned ahead of this one
        (overlap.py: speculative decoding, tensor parallelism). It is scheduled exactly as the next call
        would have scheduled it, nothing in flight; the next step() collects it. Its seconds of scheduling."""
        watch, input_before = Stopwatch(), self._input_seconds
        nxt = self.scheduler.schedule()
        if nxt.chunks:  # (nothing to run: the next step() schedules again, and waits for the tiers)
            self.overlap_counters.early_sent_steps += 1
            self._send(nxt)
            self._in_flight = nxt
        return watch.lap() - (self._input_seconds - input_before)

    def _send(self, out: SchedulerOutput) -> None:
        """Send a step scheduled with nothing in flight, its drafts assigned first."""
        self.overlap_counters.sync_steps += 1
        if self.speculation is not None:  # no overlap then: num_lookahead_tokens > 0
            self.speculation.assign(out.chunks, self.parts.max_model_len)
        self.workers.broadcast(self._build(out.chunks, False))

    def _wait_for_tiers(self) -> None:
        """Nothing to run: wait (briefly, so that new requests are taken) for what the next step waits
        on, a load's ack or a lookup's answer, instead of spinning. Either wait ends when it arrives."""
        lookup = self.parts.resources.lookup
        if self.kv.has_loads_in_flight():
            self.kv.wait_for_loads(_TIER_WAIT_S)
        elif lookup is not None and self.kv.has_pending_lookups():
            lookup.wait(_TIER_WAIT_S)

    def drain(self) -> None:
        """Collect the step in flight (overlap.py), its news kept for the next step's deltas."""
        out, self._in_flight = self._in_flight, None
        if out is None:
            return
        try:
            self._pending_outputs.extend(self._finish_step(out))
        except Exception as e:
            self._die(f"{type(e).__name__}: {e}")
            raise EngineDeadError(self._dead) from e

    def _finish_step(self, out: SchedulerOutput) -> set[str]:
        """Collect the step `out` was sent as and apply its tokens; the user requests touched."""
        first = self._collect()
        if first.error is not None:
            self.steps.resend_whole(c.request.request_id for c in out.chunks)  # its diffs may be lost
            if self._in_flight is not None:
                # the step planned ahead fed this step's tokens: its answer is discarded (the worker refuses
                # a placeholder whose step failed) and this step's parts are re-run synchronously
                self._collect()
                self.steps.resend_whole(c.request.request_id for c in self._in_flight.chunks)
                self._in_flight = None
                self.overlap_counters.discarded_steps += 1
        # INVARIANT (overlap.py): a chunk of a request that finished while its step ran (a stop one step
        # late, an abort) is discarded whole: no token appended, no cursor moved, no block cached, no R3 row
        live = [c for c in out.chunks if not c.request.is_finished]
        self.overlap_counters.discarded_chunks += len(out.chunks) - len(live)
        out = replace(out, chunks=live)
        self._run_step(out, first)
        touched = set()
        for chunk in out.chunks:
            touched.add(self.groups.group_of(chunk.request.request_id))
            if chunk.request.is_finished:
                self.steps.finished(chunk.request.request_id)
        return touched

    def _run_step(self, out: SchedulerOutput, first: StepAttempt) -> None:
        # a failed step is bisected so that only the requests that make it fail fail; the whole step
        # already ran once (`first`)
        answers = [first]

        def run(chunks: list[ScheduledChunk], retry: bool) -> StepAttempt:
            return answers.pop() if answers else self._run_batch(chunks, retry)

        step = run_isolating_failures(out.chunks, run)
        for chunk, error in step.failed:
            # nothing of a failed chunk is trusted: its cursor stays, its blocks are not cached
            logger.error("request %s failed the model step on its own: %s", chunk.request.request_id, error)
            self.token_processor.finish(chunk.request, RequestStatus.FINISHED_ERROR, error=(
                f"the model step failed on this request alone ({error.kind}); the other "
                "requests of the step were served; the engine log has the details"))
        served = [c for c in out.chunks if not c.request.is_finished]
        self.scheduler.update_after_step(replace(out, chunks=served))
        for chunk in served:
            req, rid = chunk.request, chunk.request.request_id
            if rid in step.prompt_logprobs:
                self.token_processor.add_prompt_logprobs(req, *step.prompt_logprobs[rid])
            if chunk.samples:
                if self.speculation is not None:
                    self.speculation.record(chunk, len(step.sampled[rid]))
                self.token_processor.append_tokens(req, step.sampled[rid], step.logprobs.get(rid))
                if self.speculation is not None and rid in step.draft_token_ids:
                    self.speculation.worker_drafts(req, step.draft_token_ids[rid])

    def _run_batch(self, chunks: list[ScheduledChunk], retry: bool) -> StepAttempt:
        """One worker step over `chunks` (step_isolation.py calls it again on parts of a failed step)."""
        self.workers.broadcast(self._build(chunks, retry))
        return self._collect()

    def _build(self, chunks: list[ScheduledChunk], retry: bool) -> StepInput:
        watch = Stopwatch()
        step_input = self.steps.build(chunks, retry)
        self._input_seconds += watch.lap()
        return step_input

    def _collect(self) -> StepAttempt:
        watch = Stopwatch()
        outs = self.workers.collect(timeout=self.config.parallel_config.worker_step_timeout_s)
        self._worker_seconds += watch.lap()
        self.overlap_counters.launched_ahead_steps += int(outs[0].launched_ahead)
        errors = [o.error for o in outs if o.error is not None]
        if errors:
            return StepAttempt(error=errors[0])
        o = outs[0]  # rank 0 samples
        return StepAttempt(sampled=o.sampled_token_ids, logprobs=o.logprobs, prompt_logprobs=o.prompt_logprobs,
                           draft_token_ids=o.draft_token_ids)

    # -- supervision --------------------------------------------------------------------------------

    def degraded(self) -> dict[str, str]:
        """What works less well than configured, for /health: {"kv_storage": why, "cache_transfer": why}."""
        res, out = self.parts.resources, {}
        if res.lookup is not None and (why := res.lookup.health.degraded) is not None:
            out["kv_storage"] = why
        if res.transfers is not None and res.transfers.failed is not None:
            out["cache_transfer"] = res.transfers.failed
        return out

    def _check_alive(self) -> None:
        if self._dead is not None or self._closed:
            raise EngineDeadError(self._dead or "the engine was shut down")

    def _die(self, reason: str) -> None:
        """Fail every in-flight request with the reason and stop the children."""
        self._dead = f"engine failed: {reason}"
        self._in_flight = None
        logger.error(self._dead)
        for group in self.groups.groups():
            for req in group.children:
                if not req.is_finished:
                    self.token_processor.fail(req, self._dead)
            self._pending_outputs.append(group.request_id)
        self.parts.resources.stop_children()

    def fail_all(self) -> list[RequestDelta]:
        """Outputs of the requests failed by a dead engine (call after EngineDeadError)."""
        outs = self.groups.collect(set(self._pending_outputs))
        self._pending_outputs.clear()
        return outs

    def metrics(self) -> dict[str, float]:
        """The engine's counters and gauges, by /metrics name (engine_metrics.py)."""
        return engine_metrics(self)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._dead is None:
            try:
                self.kv.poll_transfers(block=True)  # the write-through still in flight
            except Exception:
                logger.exception("waiting for write-through")
        self.kv.close()  # the KV connectors: their lookup threads and store connections
        self.parts.resources.close()
        _live_engines.discard(self)


class _DrainFirst:
    """The workers as the control plane calls them: the step in flight is collected first, so that the
    control message's answers are the next ones on the pipes."""

    def __init__(self, engine: EngineService) -> None:
        self.engine = engine

    def call(self, msg: object, timeout: float | None = None, while_waiting: Callable[[], None] | None = None) -> list:
        self.engine.drain()
        return self.engine.workers.call(msg, timeout=timeout, while_waiting=while_waiting)


_live_engines: weakref.WeakSet[EngineService] = weakref.WeakSet()


@atexit.register
def _shutdown_live_engines() -> None:
    for eng in list(_live_engines):
        try:
            eng.shutdown()
        except Exception:
            pass
