"""Where the engine's output path spends its time per decode step, on the CPU with a tiny fake model.

    python tools/profile_output_path.py --running 64 256 [--steps 20] [--r3] [--stop] [--cprofile]
    python tools/profile_output_path.py --host-only --steps 200     # no model: the output path alone
    python tools/profile_output_path.py --r3-payload 768,48,8         # one /generate answer's R3, API side

An EngineService runs in this process (its workers are processes, as in the server); `running`
requests decode together (ignore_eos). Per decode step it prints the engine's step counters
(engine/step_counters.py: schedule / input / worker / output) and what crossing to the API server costs:
packing the step's outputs for the wire (engine side: engine/output_wire.py + pickle) and unpacking
them with the detokenization the engine left (server side), measured on the step's own outputs.
`--stop` gives every request a stop string (the path that detokenizes in the engine), `--cprofile`
the top functions of the output part. `--r3-payload ROWS,LAYERS,K` times what the engine and API server do with
one finished request's R3 for /generate (SGLang's int32 base64, entrypoints/native/serving_generate.py):
the engine's gather, encoding it, serialising the answer (json.dumps scanning the payload, spliced in as
text, or the bytes /generate writes: entrypoints/payload_json.py), and a batch of such rows crossing the
engine's ZMQ socket inside the pickle or as frames of their own (engine/zmq_frames.py).
"""

from __future__ import annotations

import argparse
import cProfile
import pickle
import pstats
import tempfile
import time

import numpy as np
from fake_model import make_fake_model

from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.engine.detokenizer import DeltaDetokenizer
from fastdeploy_r3.engine.engine_service import EngineService
from fastdeploy_r3.engine.messages import OutputBatch
from fastdeploy_r3.engine.request_groups import RequestGroups
from fastdeploy_r3.engine.token_processor import TokenProcessor
from fastdeploy_r3.engine.tokenizer import Tokenizer
from fastdeploy_r3.sampling_params import SamplingParams


def profile(model_dir: str, running: int, steps: int, r3: bool, stop: bool, use_cprofile: bool,
            engine_detokenizes: bool) -> dict[str, float]:
    rr = {"enable_routing_replay": r3}
    config = EngineConfig.from_kwargs(
        model_dir, block_size=16, max_num_seqs=running, max_num_batched_tokens=max(2048, running * 16),
        device="cpu", dtype="float32", routing_replay_config=rr,
    )
    svc = EngineService(config)
    svc.token_processor.detokenize_all = engine_detokenizes
    try:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True,
                                stop=["zzzz-never"] if stop else None)
        for i in range(running):
            svc.add_request(f"r{i}", [1 + (i + j) % 200 for j in range(16)], params)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in svc.unfinished_requests()):
            svc.step()  # prefill
        detoks = {f"r{i}": DeltaDetokenizer(svc.tokenizer, params) for i in range(running)}
        for d in svc.step():
            detoks[d.request_id].fill(d)
        before = dict(svc.metrics())
        pack_s = unpack_s = 0.0
        nbytes = 0
        prof = cProfile.Profile() if use_cprofile else None
        for _ in range(steps):
            if prof is not None:
                prof.enable()
            deltas = svc.step()
            if prof is not None:
                prof.disable()
            t0 = time.perf_counter()
            data = pickle.dumps(OutputBatch.of(deltas), protocol=pickle.HIGHEST_PROTOCOL)
            t1 = time.perf_counter()
            for d in pickle.loads(data).unpack():  # the API server: unpack, detokenize what the engine left
                detoks[d.request_id].fill(d)
            unpack_s += time.perf_counter() - t1
            pack_s += t1 - t0
            nbytes += len(data)
        after = svc.metrics()
        n = after["steps"] - before["steps"]
        row = {k: 1e3 * (after[f"step_{k}_seconds"] - before[f"step_{k}_seconds"]) / n
               for k in ("schedule", "input", "worker", "output")}
        row.update(pack=1e3 * pack_s / steps, unpack=1e3 * unpack_s / steps, kib=nbytes / steps / 1024)
        if prof is not None:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(r"engine_service|token_processor|request_groups|detok|outputs",
                                                                    25)
        return row
    finally:
        svc.shutdown()


class _NoBlocks:
    """The Scheduler's part the token processor calls without R3: nothing to free."""

    def advance(self, req: object, num_tokens: int) -> None:
        req.num_computed_tokens += num_tokens  # type: ignore[attr-defined]

    def release(self, req: object, status: object) -> None:
        req.status = status  # type: ignore[attr-defined]


def host_only(model_dir: str, running: int, steps: int, engine_detokenizes: bool) -> dict[str, float]:
    """The output path alone, no model: `running` requests get one token a step (the fake tokenizer's
    ids cycling through text), through TokenProcessor, RequestGroups.collect and the wire, old way
    (the engine detokenizes, objects pickled) or new (the server detokenizes, packed)."""
    tok = Tokenizer(model_dir)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. Grüße, 日本! " * 8)
    tp = TokenProcessor(_NoBlocks(), tok, [], 1 << 20, None)  # type: ignore[arg-type]
    tp.detokenize_all = engine_detokenizes
    groups = RequestGroups(tp, None)
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    reqs = [groups.fan_out(f"cmpl-{i}", [1, 2, 3], params, None, "0").children[0] for i in range(running)]
    detoks = {f"cmpl-{i}": DeltaDetokenizer(tok, params) for i in range(running)}
    engine_s = send_s = server_s = 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        for i, req in enumerate(reqs):
            tp.append_tokens(req, [ids[(i + step) % len(ids)]])
        deltas = groups.collect({r.request_id for r in reqs})
        t1 = time.perf_counter()
        data = pickle.dumps(deltas if engine_detokenizes else OutputBatch.of(deltas), protocol=pickle.HIGHEST_PROTOCOL)
        t2 = time.perf_counter()
        got = pickle.loads(data)
        for d in (got if engine_detokenizes else got.unpack()):
            detoks[d.request_id].fill(d)
        t3 = time.perf_counter()
        engine_s, send_s, server_s = engine_s + t1 - t0, send_s + t2 - t1, server_s + t3 - t2
    return {"output": 1e3 * engine_s / steps, "pack": 1e3 * send_s / steps, "unpack": 1e3 * server_s / steps}


def r3_payload(rows: int, layers: int, top_k: int, repeats: int = 30, batch: int = 64) -> dict[str, float]:
    """ms per answer: the engine's gather, the API server's check and encoding of [rows, layers, top_k]
    uint8 rows, the answer's JSON (json.dumps scanning the payload / spliced as text, str -> bytes / the
    bytes /generate writes now), and a batch of `batch` finished answers' rows crossing a real ZMQ socket
    in the pickle vs as frames of their own (engine/zmq_frames.py)."""
    import json
    import pickle

    import zmq

    from fastdeploy_r3.engine.messages import OutputBatch
    from fastdeploy_r3.engine.zmq_frames import dumps_frames, loads_frames
    from fastdeploy_r3.entrypoints.native.serving_generate import sglang_routed_experts
    from fastdeploy_r3.entrypoints.payload_json import SplicedJson
    from fastdeploy_r3.outputs import CompletionDelta, RequestDelta
    from fastdeploy_r3.r3.layouts import check_moe_rows

    moe = np.random.default_rng(0).integers(0, 128, (rows, layers, top_k)).astype(np.uint8)

    def answer(payload: str) -> dict:
        return {"text": "x" * 1000, "output_ids": list(range(256)), "meta_info": {"routed_experts": payload}}

    def timed(fn, per: int = 1) -> float:  # noqa: ANN001
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats / per * 1e3

    buffer = sglang_routed_experts(moe, list(range(layers)), layers)
    payload = bytes(buffer).decode("ascii")
    gather = _engine_gather(moe, num_experts=128)

    def spliced_text() -> bytes:
        s = SplicedJson()
        return f"data: {s.dumps(answer(s.hold(payload)), allow_nan=False)}\n\n".encode()

    def spliced_bytes() -> bytes:
        s = SplicedJson()
        return s.dumps_bytes(answer(s.hold(buffer)), prefix="data: ", suffix="\n\n", allow_nan=False)

    assert spliced_bytes() == spliced_text() == f"data: {json.dumps(answer(payload), allow_nan=False)}\n\n".encode()
    finished = OutputBatch.of([  # distinct arrays: pickle would send one shared array once
        RequestDelta(f"r{i}", [CompletionDelta(0, "x", [1], "length", routed_experts=moe.copy())], finished=True)
        for i in range(batch)])
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    pull.connect(f"tcp://127.0.0.1:{port}")

    def in_pickle() -> None:
        push.send(pickle.dumps(finished, protocol=pickle.HIGHEST_PROTOCOL))
        pickle.loads(pull.recv()).unpack()

    def as_frames() -> None:
        push.send_multipart(dumps_frames(finished), copy=False)
        loads_frames(pull.recv_multipart(copy=False)).unpack()

    try:
        return {"gather": timed(gather), "check": timed(lambda: check_moe_rows(moe, list(range(layers)), rows, top_k)),
                "encode": timed(lambda: sglang_routed_experts(moe, list(range(layers)), layers)),
                "json_dumps": timed(lambda: json.dumps(answer(payload), allow_nan=False)),
                "spliced": timed(spliced_text), "bytes": timed(spliced_bytes), "mib": len(payload) / 2**20,
                "wire_pickle": timed(in_pickle, batch), "wire_frames": timed(as_frames, batch)}
    finally:
        gather.close()  # type: ignore[attr-defined]
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def _engine_gather(moe: np.ndarray, num_experts: int):  # noqa: ANN202
    """A callable doing the engine's gather of moe's rows out of a host routing buffer (block size 16),
    with every check it runs at a request's finish; .close() frees the buffer."""
    import uuid

    from fastdeploy_r3.cache_manager.routing_buffer import RoutingBuffer, RoutingBufferSpec
    from fastdeploy_r3.cache_manager.routing_cache_manager import RoutingCacheManager

    rows, layers, top_k = moe.shape
    blocks = -(-rows // 16)
    spec = RoutingBufferSpec(f"fdr3_prof_{uuid.uuid4().hex[:8]}", 4 * blocks * 16, layers, top_k, "uint8")
    buf = RoutingBuffer.create(spec)
    table = list(range(blocks, 2 * blocks))  # the request's blocks, somewhere in the middle of the pool
    slots = np.asarray([table[p // 16] * 16 + p % 16 for p in range(rows)], dtype=np.int64)
    buf.write(moe, slots, np.full(rows, 7, dtype=np.int64))
    manager = RoutingCacheManager(buf, 16, num_experts)

    def gather() -> np.ndarray:
        return manager.gather("r", table, [7] * blocks, 0, rows)

    gather.close = buf.close  # type: ignore[attr-defined]
    assert np.array_equal(gather(), moe)
    return gather


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--r3", action="store_true")
    ap.add_argument("--stop", action="store_true")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--host-only", action="store_true",
                    help="no model: the output path alone, old way (engine detokenizes, objects) and new")
    ap.add_argument("--engine-detokenizes", action="store_true",
                    help="detokenize every request in the engine loop (the in-process LLM's way)")
    ap.add_argument("--r3-payload", default="", help="ROWS,LAYERS,K: time one /generate answer's R3 (no model)")
    args = ap.parse_args()
    if args.r3_payload:
        rows, layers, top_k = (int(x) for x in args.r3_payload.split(","))
        r = r3_payload(rows, layers, top_k)
        print("rows x layers x K     engine_gather_ms  api_check_ms  payload_MiB  encode_ms  json.dumps_ms  "
              "spliced_text_ms  answer_bytes_ms  socket_pickle_ms  socket_frames_ms")
        print(f"{args.r3_payload:20s}  {r['gather']:16.2f}  {r['check']:12.2f}  {r['mib']:11.2f}  {r['encode']:9.2f}  "
              f"{r['json_dumps']:13.2f}  {r['spliced']:15.2f}  {r['bytes']:15.2f}  {r['wire_pickle']:16.2f}  "
              f"{r['wire_frames']:16.2f}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_fake_model("qwen3_moe", tmp)
        if args.host_only:
            print("running  way                         engine_output_ms  engine_send_ms  server_unpack+detok_ms")
            for running in args.running:
                for old in (True, False):
                    r = host_only(model_dir, running, args.steps, old)
                    way = "engine detok, objects" if old else "server detok, packed"
                    print(f"{running:7d}  {way:26s}  {r['output']:16.2f}  {r['pack']:14.2f}  {r['unpack']:22.2f}")
            return
        print("running  schedule_ms  input_ms  worker_ms  output_ms  pack_ms  unpack+detok_ms  wire_KiB")
        for running in args.running:
            r = profile(model_dir, running, args.steps, args.r3, args.stop, args.cprofile, args.engine_detokenizes)
            print(f"{running:7d}  {r['schedule']:11.2f}  {r['input']:8.2f}  {r['worker']:9.2f}  {r['output']:9.2f}  "
                  f"{r['pack']:7.2f}  {r['unpack']:15.2f}  {r['kib']:8.1f}")


if __name__ == "__main__":
    main()
