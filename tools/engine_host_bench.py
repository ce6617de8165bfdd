"""Host time of the engine process per decode step, on the CPU with a tiny fake model.

    python tools/engine_host_bench.py --batch 64 256 --steps 40 [--disable-overlap-schedule] [--profile N]
        [--speculative K] [--gpu-ms MS] [--no-send-early]

Starts an EngineService (one worker process running HostOnlyRunner: it prepares each step's inputs as
the real runner does but skips the model and answers token 7 for every sampling request, so that
the engine's host work is what is measured, not a CPU forward), admits `batch` requests (prompt --prompt-len random ids,
ignore_eos, R3 on), lets every one reach decode, then times --steps decode steps and prints, per step:
wall ms, and the engine process's host work in CPU ms (time.process_time in step() outside the wait for
the workers' answers: scheduling, building and pickling the step message, unpickling the answer, stop
checks, deltas; the polling while it waits and the worker's own time are not in it), and with --profile
the N functions of the engine process with the most cumulative time (cProfile). --speculative K: n-gram
speculation with K drafts (the engine drafts from each request's history; the runner still answers one
token, so every draft is rejected): the host work of a speculative engine's steps, which run one at a time.
--gpu-ms MS: the runner also sleeps MS per step, standing in for the device, each step's deltas are packed
as engine_process.py's loop packs them before sending (OutputBatch), and detokenization is left to the
API server as the engine process leaves it: "exposed" is then the wall time a step takes beyond MS, the
host work the device waits for. --no-send-early: each step sent only when the next step() starts, after
the deltas (the engine before engine_service.py's send_early), to set beside it.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import os
import pickle
import pstats
import random
import tempfile
import time

from fake_model import make_fake_model

from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.engine.engine_service import EngineService
from fastdeploy_r3.engine.messages import OutputBatch
from fastdeploy_r3.sampling_params import SamplingParams
from fastdeploy_r3.worker.messages import StepInput, StepOutput
from fastdeploy_r3.worker.model_runner import ModelRunner


class HostOnlyRunner(ModelRunner):
    """The worker's host side of a step (forget the finished, prepare the inputs), no model; with
    FDR3_BENCH_GPU_MS set, a sleep that long in place of the device's step."""

    gpu_s = float(os.environ.get("FDR3_BENCH_GPU_MS", "0")) / 1e3

    def execute(self, step: StepInput) -> StepOutput:
        for rid in step.finished_request_ids:
            self.sampler.forget(rid)
            if hasattr(self.input_batcher, "forget"):
                self.input_batcher.forget(rid)
        out = StepOutput(step.step_id, {})
        if step.requests:
            self.input_batcher.prepare(step.requests)
            out.sampled_token_ids = {r.request_id: [7] for r in step.requests if r.sample}
            if self.gpu_s:
                time.sleep(self.gpu_s)
        return out


def measure(model_dir: str, batch: int, steps: int, prompt_len: int, overlap_off: bool,
            profile: int, speculative: int = 0, gpu_ms: float = 0.0, send_early: bool = True) -> dict[str, float]:
    max_len = prompt_len + steps + 64
    kwargs = dict(block_size=16, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * prompt_len),
                  max_model_len=max_len, num_gpu_blocks_override=batch * max_len // 16,
                  routing_replay_config={"enable_routing_replay": True})
    if speculative:
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": speculative,
                                        "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if "disable_overlap_schedule" in inspect.signature(EngineConfig.from_kwargs).parameters or overlap_off:
        kwargs["disable_overlap_schedule"] = overlap_off
    import engine_host_bench  # the runner by its module name: the spawned worker imports it (not __main__)

    os.environ["FDR3_BENCH_GPU_MS"] = str(gpu_ms)  # read by the spawned worker's HostOnlyRunner

    engine = EngineService(EngineConfig.from_kwargs(model_dir, **kwargs), runner_cls=engine_host_bench.HostOnlyRunner)
    engine.send_early = getattr(engine, "send_early", False) and send_early
    if gpu_ms:  # the API server detokenizes (engine_process.py), but for requests with stop strings
        engine.token_processor.detokenize_all = False
    rng = random.Random(0)
    try:
        params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"r{i}", [rng.randrange(3, 500) for _ in range(prompt_len)], params)
        for _ in range(10):  # prefill, then a few decode steps
            engine.step()
        workers, waited = engine.workers, [0.0]
        collect = workers.collect

        def timed_collect(*a: object, **kw: object) -> object:
            t = time.process_time()
            try:
                return collect(*a, **kw)
            finally:
                waited[0] += time.process_time() - t

        workers.collect = timed_collect
        call = workers.call

        def timed_call(msg: object, *a: object, **kw: object) -> object:  # the synchronous path's send + collect
            workers.broadcast(msg)
            return timed_collect(*a, **kw)

        if not hasattr(engine, "drain"):  # an engine without overlap sends with call()
            workers.call = timed_call
        del call
        prof = cProfile.Profile() if profile else None
        wall0, cpu0 = time.perf_counter(), time.process_time()
        if prof is not None:
            prof.enable()
        for _ in range(steps):
            deltas = engine.step()
            if gpu_ms and deltas:
                pickle.dumps(OutputBatch.of(deltas), protocol=pickle.HIGHEST_PROTOCOL)
        if prof is not None:
            prof.disable()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        if prof is not None:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(profile)
            print(s.getvalue())
        return {"wall_ms": 1e3 * wall / steps, "engine_cpu_ms": 1e3 * (cpu - waited[0]) / steps,
                "exposed_ms": 1e3 * wall / steps - gpu_ms}
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--disable-overlap-schedule", action="store_true")
    ap.add_argument("--profile", type=int, default=0, help="print the top N functions by cumulative time")
    ap.add_argument("--speculative", type=int, default=0, metavar="K", help="n-gram speculation, K drafts a step")
    ap.add_argument("--gpu-ms", type=float, default=0.0, metavar="MS", help="the runner sleeps MS a step (the device)")
    ap.add_argument("--no-send-early", action="store_true", help="send each step after the deltas of the one before")
    args = ap.parse_args()
    model_dir = make_fake_model("qwen3_moe", tempfile.mkdtemp(prefix="fdr3-bench-"))
    for b in args.batch:
        r = measure(model_dir, b, args.steps, args.prompt_len, args.disable_overlap_schedule, args.profile,
                    args.speculative, args.gpu_ms, not args.no_send_early)
        exposed = f", {r['exposed_ms']:.2f} ms/step exposed beyond --gpu-ms" if args.gpu_ms else ""
        print(f"batch {b:4d}: {r['wall_ms']:.2f} ms/step wall, "
              f"{r['engine_cpu_ms']:.2f} ms/step engine-process host work (CPU){exposed}")


if __name__ == "__main__":
    main()
