"""Serving a dict of requests on an EngineService step by step, for the engine tests (imported by them
as a module of this directory, like failing_runner.py)."""

from __future__ import annotations

from fastdeploy_r3.engine.engine_service import EngineService
from fastdeploy_r3.outputs import OutputAssembler, RequestOutput
from fastdeploy_r3.sampling_params import SamplingParams


def run_requests(engine: EngineService, requests: dict[str, tuple[list[int], SamplingParams]],
                 abort_after: dict[str, int] | None = None, max_steps: int = 500) -> dict[str, RequestOutput]:
    """Add every request at once and step until all finished; abort_after: request id -> abort it once it
    has that many tokens. AssertionError if the engine is still busy after max_steps."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    assemblers = {rid: OutputAssembler(rid) for rid in requests}
    done: dict[str, RequestOutput] = {}
    abort_after = dict(abort_after or {})
    for _ in range(max_steps):
        for delta in engine.step():
            assemblers[delta.request_id].add(delta)
            if delta.finished:
                done[delta.request_id] = assemblers[delta.request_id].output()
        for rid, n in list(abort_after.items()):
            if len(assemblers[rid].output().outputs[0].token_ids) >= n:
                engine.abort_request(rid)
                del abort_after[rid]
        if not engine.has_unfinished_requests():
            return done
    raise AssertionError("the engine made no progress")
