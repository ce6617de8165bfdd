"""Decode and prefill steps of one ModelRunner, driven in-process (no engine, no pipes), for bench_r3.py.

    bench = StepBench(model_dir, device="cuda", dtype="bfloat16", load_format="dummy", max_batch=256, ...)
    bench.prefill(batch, prompt_len)             # the batch's prompts, in chunks of max_num_batched_tokens
    times = bench.decode(steps, r3_pattern)      # one decode step per entry, R3 on/off as the pattern says
    periods = bench.decode_pipelined(steps)      # the server worker's way: launched ahead, sent as diffs
    bench.roofline_bytes(batch)                  # bytes the last R3-on decode step had to read

R3 on/off is switched per step by attaching or detaching the runner's routing capture, so a paired A/B
runs in one process on one model: "on" captures every MoE layer's top-k and scatters the rows into the
registered SHM routing_host_buffer, "off" does neither.

Roofline bytes of a decode step (what must be read at least once): the experts the step's tokens were
routed to (counted per layer from the step's R3 rows), every other weight except the embedding table
(attention, norms, routers, dense and shared MLPs, lm_head), the embedding rows of the batch, and the KV
cache of every request's context.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer, RoutingBufferSpec
from fastdeploy_r3.cache_manager.shm import new_engine_suffix, shm_name, unlink_all
from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.model_executor.layers.moe import StackedExperts
from fastdeploy_r3.sampling_params import SamplingParams
from fastdeploy_r3.worker.messages import PLACEHOLDER_TOKEN, ScheduledRequestData, StepInput, StepOutput
from fastdeploy_r3.worker.model_runner import LaunchedStep, ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


def profile_table(run: Callable[[], object], device_type: str, path: str) -> tuple[Any, float]:
    """torch.profiler over run() (CPU, and CUDA on a GPU); its table, sorted by device time (CPU time on the
    CPU), written to path; -> (the profiler's key_averages(), seconds from starting the profiler to its stop)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device_type == "cuda"
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    with open(path, "w") as f:
        f.write(events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=60))
    return events, wall


class StepBench:
    def __init__(
        self,
        model_dir: str,
        device: str,
        dtype: str,
        load_format: str,
        max_batch: int,
        max_len: int,
        num_blocks: int,
        block_size: int = 16,
        max_num_batched_tokens: int = 8192,
        enforce_eager: bool = False,
        deterministic: bool = False,
        quantization: str | None = None,
        speculative_config: dict | None = None,
    ) -> None:
        """max_len: the longest sequence (prompt + decode steps); num_blocks: KV blocks for the largest batch.
        Decode steps replay CUDA graphs unless enforce_eager (or the attention backend is not graph-safe).
        deterministic: the batch-invariant kernels (--enable-deterministic-inference); quantization: "fp8"
        quantizes the (dummy or checkpoint) weights block-wise at load (--quantization fp8). speculative_config:
        the engine's (--speculative-config): under {"method": "mtp"} every step also runs the draft layer."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.config = EngineConfig.from_kwargs(
            model_dir, device=device, dtype=dtype, load_format=load_format, block_size=block_size,
            max_num_seqs=max_batch, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len,
            num_gpu_blocks_override=num_blocks, routing_replay_config={"enable_routing_replay": True},
            enforce_eager=enforce_eager, enable_deterministic_inference=deterministic,
            quantization=quantization or "none", speculative_config=speculative_config,
        )  # fmt: skip
        self.suffix = new_engine_suffix()
        self.runner = ModelRunner(self.config, 0, 1, self.suffix)
        t0 = time.perf_counter()
        self.runner.load_model()
        self._sync()
        self.load_s = time.perf_counter() - t0
        self.runner.init_kv_cache(num_blocks)
        rr = self.config.routing_replay_config
        spec = RoutingBufferSpec(shm_name(self.suffix, "routing_host"), num_blocks * block_size, rr.num_moe_layers,
                                 rr.moe_top_k, rr.routing_dtype.name)  # fmt: skip
        self.routing_host = RoutingBuffer.create(spec)
        self.runner.attach_routing(spec)
        t0 = time.perf_counter()
        self.runner.capture_decode_graphs()
        self.graph_capture_s = time.perf_counter() - t0
        self._capture = self.runner.routing_capture
        self._writer = self.runner.routing_writer
        self._next_id = 0
        self.requests: list[tuple[str, list[int], int]] = []  # (request id, block table, next position)
        self.last_tokens: dict[str, int] = {}
        self.sampled: list[dict[str, list[int]]] = []  # every step's tokens, in order
        self.host_prep_s: list[float] = []
        self._wrap_prepare()

    # -- plumbing -----------------------------------------------------------------------------------

    def _sync(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def _wrap_prepare(self) -> None:
        batcher = self.runner.input_batcher
        prepare = batcher.prepare

        def timed(requests):  # noqa: ANN001, ANN202
            t0 = time.perf_counter()
            out = prepare(requests)
            self.host_prep_s.append(time.perf_counter() - t0)
            return out

        batcher.prepare = timed  # type: ignore[method-assign]

    def set_r3(self, on: bool) -> None:
        self.runner.routing_capture = self._capture if on else None
        self.runner.routing_writer = self._writer if on else None

    def _step(self, requests: list[ScheduledRequestData]) -> dict[str, list[int]]:
        self._next_id += 1
        return self._record(self.runner.execute(StepInput(self._next_id, requests)))

    def _record(self, out: StepOutput) -> dict[str, list[int]]:
        if out.error:
            raise RuntimeError(f"step {out.step_id} failed: {out.error}")
        self.last_tokens.update({rid: toks[-1] for rid, toks in out.sampled_token_ids.items()})
        self.sampled.append(out.sampled_token_ids)
        return out.sampled_token_ids

    def _whole(self) -> list[ScheduledRequestData]:
        """A decode step of every request sent whole: its last token and its full block table."""
        return [ScheduledRequestData(rid, [self.last_tokens[rid]], pos, table, [1] * len(table), sample=True)
                for rid, table, pos in self.requests]  # fmt: skip

    def _check_room(self, steps: int) -> None:
        for rid, table, pos in self.requests:
            if pos + steps > len(table) * self.block_size:
                raise ValueError(f"request {rid} at position {pos} holds {len(table)} KV blocks: too few for "
                                 f"{steps} more decode steps (prefill's reserve)")

    # -- phases -------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every request (their KV blocks are reused by the next prefill)."""
        done = [rid for rid, _, _ in self.requests]
        self.runner.execute(StepInput(0, [], finished_request_ids=done))
        self.requests, self.last_tokens = [], {}

    def prefill(self, prompts: Sequence[Sequence[int]], reserve: int = 0) -> float:
        """Prefill every prompt (R3 on), packed into steps of max_num_batched_tokens, with KV blocks for
        `reserve` more tokens each (the decode steps to come); returns seconds."""
        self.reset()
        self.set_r3(True)
        budget = self.config.scheduler_config.max_num_batched_tokens
        next_block = 0
        for i, p in enumerate(prompts):
            n = -(-(len(p) + reserve) // self.block_size)
            if next_block + n > self.num_blocks:
                raise ValueError(f"{len(prompts)} prompts of {len(p)} + {reserve} tokens need more than the "
                                 f"{self.num_blocks} KV blocks this bench allocated")
            self.requests.append((f"r{i}", list(range(next_block, next_block + n)), 0))
            next_block += n
        self._sync()
        t0 = time.perf_counter()
        pending = [(i, 0) for i in range(len(prompts))]  # (request index, tokens done)
        while pending:
            chunk, used = [], 0
            while pending and used < budget:
                i, done = pending.pop(0)
                n = min(len(prompts[i]) - done, budget - used)
                rid, table, _ = self.requests[i]
                last = done + n == len(prompts[i])
                chunk.append(ScheduledRequestData(rid, list(prompts[i][done : done + n]), done, table,
                                                  [1] * len(table), sample=last,
                                                  sampling_params=GREEDY if done == 0 else None))  # fmt: skip
                used += n
                if not last:
                    pending.insert(0, (i, done + n))
            self._step(chunk)
        self._sync()
        self.requests = [(rid, table, len(p)) for (rid, table, _), p in zip(self.requests, prompts)]
        return time.perf_counter() - t0

    def decode(self, r3_pattern: Sequence[bool]) -> list[float]:
        """One decode step of the whole batch per entry of r3_pattern; seconds per step (host clock,
        the step ends at its sampled-token sync)."""
        self._check_room(len(r3_pattern))
        times = []
        for on in r3_pattern:
            self.set_r3(on)
            step = self._whole()
            t0 = time.perf_counter()
            self._step(step)
            times.append(time.perf_counter() - t0)
            self.requests = [(rid, table, pos + 1) for rid, table, pos in self.requests]
        self.set_r3(True)
        return times

    def decode_pipelined(self, steps: int, r3_on: bool = True) -> list[float]:
        """`steps` decode steps of the whole batch the way the server's worker runs them (worker_process.py
        StepPipeline): step i+1 is launched before step i is finished, so the device never waits for the
        host's input preparation or the sampled-id wait; seconds between consecutive finishes, one per step
        (the first from the first launch: it has no overlap, take a median).

        The first step sends every request whole (its last token, its full table): the step before it may
        be a prefill chunk or a step of another kind. Every later one is what the engine's step builder sends
        a running request (engine/step_builder.py, engine/overlap.py): PLACEHOLDER_TOKEN, which the runner
        fills on the device with the id this request sampled in step id - 1 (so step ids stay consecutive),
        and no new blocks: an empty table from blocks_from = len(table) (blocks_from 0 with an empty table
        would mean "this request holds no blocks", worker/batch_state.py)."""
        self._check_room(steps)
        self.set_r3(r3_on)
        pending: LaunchedStep | None = None
        periods: list[float] = []
        self._sync()
        last = time.perf_counter()
        for i in range(steps + 1):
            launched = None
            if i < steps:
                step = self._whole() if i == 0 else [
                    ScheduledRequestData(rid, [PLACEHOLDER_TOKEN], pos + i, [], [], sample=True, blocks_from=len(table))
                    for rid, table, pos in self.requests]  # fmt: skip
                self._next_id += 1
                launched = self.runner.launch(StepInput(self._next_id, step))
            if pending is not None:  # after the next launch, as the worker does: the device stays busy
                self._record(self.runner.finish(pending))
                now = time.perf_counter()
                periods.append(now - last)
                last = now
            pending = launched
        self.requests = [(rid, table, pos + steps) for rid, table, pos in self.requests]
        self.set_r3(True)
        return periods

    # -- roofline -----------------------------------------------------------------------------------

    def experts_touched(self, num_tokens: int) -> np.ndarray:
        """[L] distinct experts among the last R3-on step's first num_tokens rows, per MoE layer."""
        rows = self._capture.buffer[:num_tokens]  # [T, L, K] int32
        return np.array([int(torch.unique(rows[:, layer]).numel()) for layer in range(rows.shape[1])])

    def roofline_bytes(self, batch: int) -> dict[str, float]:
        """Bytes the last decode step (an R3-on one, `batch` tokens) had to read, by kind."""
        model = self.runner.model
        experts = [m for m in model.modules() if isinstance(m, StackedExperts)]
        # fp8 experts carry float32 scale rows next to w13 / w2: read with the expert they scale
        names = ("w13", "w2", "w13_weight_scale_inv", "w2_weight_scale_inv")
        expert_params = {id(getattr(m, n)) for m in experts for n in names if hasattr(m, n)}
        scales = [getattr(experts[0], n) for n in names[2:] if hasattr(experts[0], n)]
        embed = model.model.embed_tokens.weight
        dense = sum(p.numel() * p.element_size() for p in model.parameters()
                    if id(p) not in expert_params and p is not embed)  # fmt: skip
        if model.tie_word_embeddings:
            dense += embed.numel() * embed.element_size()
        per_expert = (experts[0].w13[0].numel() + experts[0].w2[0].numel()) * experts[0].w13.element_size() \
            + sum(t[0].numel() * t.element_size() for t in scales)
        touched = self.experts_touched(batch)
        kv = self.runner.kv_cache
        kv_per_token = kv.shape[0] * 2 * kv.shape[-2] * kv.shape[-1] * kv.element_size()
        context = sum(pos for _, _, pos in self.requests)  # tokens every request attends over
        return {
            "experts": float(touched.sum() * per_expert),
            "dense": float(dense),
            "embedding_rows": float(batch * embed.shape[1] * embed.element_size()),
            "kv": float(context * kv_per_token),
            "experts_touched_per_layer": float(touched.mean()),
        }

    def close(self) -> None:
        """Free the model, KV cache and SHM (a later HF comparison needs the device memory)."""
        self.set_r3(True)
        self.runner.close()
        self.runner.model = None
        self._capture = self._mapped = self._cpu_writer = None
        self.routing_host.close()
        unlink_all(self.suffix)
        if self.config.device == "cuda":
            torch.cuda.empty_cache()
