"""Where the engine loop's wall time goes, step by step, for /metrics and tools/bench_rollout.py.

One model step of the loop, timed in five parts (host time; `worker` is the workers' call, the
device's time included):

    |- schedule -|- input -|------- worker -------|- output -|- send -|
    |<------------------------- step_seconds ------------------------->|

    schedule  Scheduler.schedule (admission, blocks, preemption), also of a step planned ahead or sent early
    input     building the step's inputs (engine/step_builder.py)
    worker    the workers' call: sending the inputs, the forward, sampling, the answer
              (input and worker include the re-runs of a failed step's bisection)
    output    token processing (stops, detokenization, R3 gather at finish) and the step's deltas
    send      packing the step's outputs and handing them to the API server (engine/engine_process.py)

`steps` counts steps that ran the model; a step that only sends aborts is not one. `decode_steps` and
`decode_step_seconds` (send excluded) count the steps that fed one token per request and no prompt
chunk: the server's decode step, to set beside tools/bench_r3.py's, without the prefill steps a mean
over all steps mixes in.
bench_rollout.py divides step_seconds by steps for the engine's mean step and sets it beside the
server's TPOT.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class StepCounters:
    steps: int = 0
    step_seconds: float = 0.0
    schedule_seconds: float = 0.0
    input_seconds: float = 0.0
    worker_seconds: float = 0.0
    output_seconds: float = 0.0
    send_seconds: float = 0.0
    step_outputs: int = 0  # request deltas the steps produced
    decode_steps: int = 0
    decode_step_seconds: float = 0.0

    def add_step(self, schedule_s: float, input_s: float, worker_s: float, output_s: float,
                 num_outputs: int, decode_only: bool = False) -> None:
        """One model step's parts (the send is added by the loop that sends, with add_send)."""
        if decode_only:
            self.decode_steps += 1
            self.decode_step_seconds += schedule_s + input_s + worker_s + output_s
        self.steps += 1
        self.schedule_seconds += schedule_s
        self.input_seconds += input_s
        self.worker_seconds += worker_s
        self.output_seconds += output_s
        self.step_seconds += schedule_s + input_s + worker_s + output_s
        self.step_outputs += num_outputs

    def add_send(self, seconds: float) -> None:
        """Packing and sending one step's outputs: part of that step's wall time."""
        self.send_seconds += seconds
        self.step_seconds += seconds

    def as_metrics(self) -> dict[str, float]:
        """The names /metrics exports (fastdeploy_r3_engine_<name>_total)."""
        return {
            "steps": self.steps,
            "step_seconds": self.step_seconds,
            "step_schedule_seconds": self.schedule_seconds,
            "step_input_seconds": self.input_seconds,
            "step_worker_seconds": self.worker_seconds,
            "step_output_seconds": self.output_seconds,
            "step_send_seconds": self.send_seconds,
            "step_outputs": self.step_outputs,
            "decode_steps": self.decode_steps,
            "decode_step_seconds": self.decode_step_seconds,
        }


class Stopwatch:
    """Seconds since the previous lap (perf_counter), for timing consecutive parts of one step."""

    def __init__(self) -> None:
        self._t = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self._t = now - self._t, now
        return elapsed
