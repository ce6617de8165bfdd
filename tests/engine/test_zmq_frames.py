"""Engine outputs cross the ZMQ boundary as a pickle plus one frame per large array (engine/zmq_frames.py):
a finished batch's R3 rows arrive equal, as views of the frames, without riding inside the pickle."""

from __future__ import annotations

import numpy as np
import zmq

from fastdeploy_r3.engine.messages import OutputBatch
from fastdeploy_r3.engine.zmq_frames import OUT_OF_BAND_MIN_BYTES, dumps_frames, loads_frames
from fastdeploy_r3.outputs import CompletionDelta, RequestDelta


def _finished(rid: str, rows: np.ndarray | None) -> RequestDelta:
    choice = CompletionDelta(index=0, token_ids=[5, 6], text="ab", finish_reason="length", routed_experts=rows)
    return RequestDelta(request_id=rid, finished=True, outputs=[choice])


def test_a_batch_of_finished_r3_requests_crosses_a_real_socket_with_its_rows_out_of_band() -> None:
    big = [np.random.default_rng(i).integers(0, 128, size=(767, 48, 8), dtype=np.uint8) for i in range(3)]
    small = np.arange(2 * 48 * 8, dtype=np.uint8).reshape(2, 48, 8)  # under the threshold: in the pickle
    assert small.nbytes < OUT_OF_BAND_MIN_BYTES <= big[0].nbytes
    deltas = [_finished("r0", big[0]), _finished("r1", small), _finished("r2", None),
              _finished("r3", big[1]), _finished("r4", big[2])]
    frames = dumps_frames(OutputBatch.of(deltas))
    assert len(frames) == 1 + 3 and len(frames[0]) < big[0].nbytes  # the rows are not in the pickle

    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        port = push.bind_to_random_port("tcp://127.0.0.1")
        pull.connect(f"tcp://127.0.0.1:{port}")
        push.send_multipart(frames, copy=False)
        got = loads_frames(pull.recv_multipart(copy=False)).unpack()
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
    assert [d.request_id for d in got] == ["r0", "r1", "r2", "r3", "r4"]
    for d, rows in zip(got, [big[0], small, None, big[1], big[2]]):
        r3 = d.outputs[0].routed_experts
        assert (r3 is None) if rows is None else (r3.dtype == rows.dtype and np.array_equal(r3, rows)), d.request_id
        assert d.outputs[0].token_ids == [5, 6] and d.outputs[0].finish_reason == "length"
    assert not got[0].outputs[0].routed_experts.flags.owndata  # a view of the received frame, not a copy


def test_a_message_without_large_arrays_is_one_frame_as_before() -> None:
    frames = dumps_frames(OutputBatch.of([_finished("r0", None)]))
    assert len(frames) == 1
    assert loads_frames([bytes(frames[0])]).unpack()[0].request_id == "r0"
