"""Overlap scheduling: the engine schedules and sends step n+1 while the workers run step n (SGLang's
overlap scheduler, vLLM's async scheduling), so the engine's host work hides behind the GPU's.

    engine:   send n ─ plan + send n+1 ─ collect n, apply stops ─┐ plan + send n+2 ─ collect n+1 ─ ...
    workers:  [ step n ]            [ step n+1 (feeds n's token) ]  [ step n+2 ] ...

A chunk scheduled ahead (ScheduledChunk.ahead) feeds the token its request samples in step n, which
the engine does not know yet: the message carries PLACEHOLDER_TOKEN and the worker substitutes the
id it sampled for that request in its previous step, on the device (worker/model_runner.py).

Stops are therefore applied one step late. A request that stops on step n's token (stop id, stop
string, EOS, max_tokens, max_model_len) or is aborted while n+1 runs has one extra chunk in step n+1:

    INVARIANT: the extra chunk of a request that finished before its step was collected is discarded
    whole. Its sampled token is never appended, its cursor never moves, so the KV slot it wrote is never
    registered in the prefix cache, and its R3 row (position P + N - 1, the finished request's last
    token) lies outside the rows gathered at finish (r3/layouts.row_range ends at P + N - 1) and is
    never published. The engine's step loop skips such chunks (engine_service.py `_finish_step`).

Its blocks go back to the pool while step n+1 may still write that one slot: a block handed out again
is written only by later steps of the same workers, in order, and never reaches a cache tier before
the step that wrote it is collected (admission, loads and preemption happen in synchronous steps).

A step is planned ahead only when it needs nothing the step in flight decides; otherwise the next step
is synchronous (scheduled after the step in flight is collected), exactly the non-overlapped path:
  - a running request not in the step in flight, or whose chunk there does not sample (chunked prefill)
  - a waiting request that could be admitted (its prefix lookup, loads from the cache tiers and any
    preemption must not race a step in flight)
  - a LOADING request whose load answered (scheduler.poll_loads moves it to running): its first chunk
    is scheduled like an admission's. Its load itself may run across steps in flight: it was started
    at admission, in a synchronous step, into blocks the request holds and no step writes
  - blocks run out for a request's next slot (preemption)
  - multi-token steps (num_lookahead_tokens > 0): how many tokens they append is known only afterwards
  - tensor parallelism: only rank 0 samples, so the other ranks could not fill in the placeholder
  - the step after a failed one (engine/step_isolation.py re-runs its parts synchronously; the step
    planned ahead fed the failed step's tokens and is discarded, see worker/model_runner.py)
A request certain to finish on the token in flight (max_tokens, max_model_len) is not planned ahead.

With multi-token steps (speculation) or tensor parallelism no step is ever planned ahead; the engine then
sends each step as soon as the one before is collected and its tokens applied, before building that
one's deltas (engine_service.py `_send_next`): scheduled with nothing in flight, so none of the rules
above applies to it, while the deltas and the engine loop's sending run beside the workers' step. A
request finished meanwhile (an abort) has its chunk discarded under the same invariant.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy_r3.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput


@dataclass
class OverlapCounters:
    overlapped_steps: int = 0  # steps sent while the previous one ran
    sync_steps: int = 0  # steps scheduled after the previous one was collected
    discarded_steps: int = 0  # steps planned ahead of a step that failed: discarded, their base re-run
    discarded_chunks: int = 0  # chunks of requests that finished while their step ran (the invariant above)
    launched_ahead_steps: int = 0  # steps the worker launched on the device before finishing the one before
    early_sent_steps: int = 0  # sync steps sent before the outputs of the one before (engine_service._send_next)


def schedule_ahead(scheduler: Scheduler, in_flight: list[ScheduledChunk], max_model_len: int) -> SchedulerOutput | None:
    """The chunks of the step after `in_flight` (every decode continues), their KV slots reserved; or
    None when that step must be scheduled synchronously (see the module docstring)."""
    if scheduler.num_lookahead_tokens:
        return None
    if scheduler.waiting and len(scheduler.running) + len(scheduler.loading) < scheduler.max_num_seqs:
        return None
    if scheduler.poll_loads():
        return None
    by_id = {c.request.request_id: c for c in in_flight}
    planned: list[tuple[ScheduledChunk, int]] = []
    for req in scheduler.running:
        c = by_id.get(req.request_id)
        if c is None or not c.samples:
            return None
        params = req.sampling_params
        if len(req.output_token_ids) + 1 >= params.max_tokens or req.num_tokens + 1 >= max_model_len:
            continue  # the token in flight finishes it for certain
        end = c.start + c.num_new_tokens  # the position of the token in flight
        # slots past the confirmed cursor: the chunk in flight and the one token fed ahead
        planned.append((ScheduledChunk(req, 1, start=end, ahead=True), end + 1 - req.num_computed_tokens))
    if not planned or len(planned) > scheduler.max_num_batched_tokens:
        return None
    kv = scheduler.kv
    for chunk, slots in planned:
        if not kv.can_append(chunk.request, slots):
            return None  # preemption: a synchronous step (blocks reserved so far stay with their requests)
        kv.append_slots(chunk.request, slots)
    return SchedulerOutput(chunks=[c for c, _ in planned])


def overlap_enabled(disable_overlap_schedule: bool, tensor_parallel_size: int, num_lookahead_tokens: int) -> bool:
    """Whether steps may be planned ahead at all (per step, schedule_ahead may still say no): on unless
    disabled, on every device."""
    return not disable_overlap_schedule and tensor_parallel_size == 1 and num_lookahead_tokens == 0
