"""Engine -> API server messages as ZMQ multipart frames: the pickle, then each large array's bytes.

A step that finishes a batch of R3 requests sends their rows in one message (for a 30B MoE at 768
tokens, ~0.3 MB of uint8 rows a request, 256 requests = 75 MB). Pickled in-band, those bytes are
copied into the pickle, by ZMQ into its message, and out of the pickle again on the other side. Out of
band (pickle protocol 5), every buffer of at least OUT_OF_BAND_MIN_BYTES travels as a frame of its own
(sent without a copy) and the receiver's arrays are views of the received frames. Smaller buffers (a
decode step's token ids) stay inside the pickle.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

OUT_OF_BAND_MIN_BYTES = 64 * 1024


def dumps_frames(msg: object) -> list[Any]:
    """[pickle, buffer, ...]: what send_multipart(..., copy=False) sends for msg."""
    buffers: list[pickle.PickleBuffer] = []

    def keep_in_band(buf: pickle.PickleBuffer) -> bool:
        if buf.raw().nbytes < OUT_OF_BAND_MIN_BYTES:
            return True
        buffers.append(buf)
        return False

    head = pickle.dumps(msg, protocol=5, buffer_callback=keep_in_band)
    return [head, *(b.raw() for b in buffers)]


def loads_frames(frames: Sequence[Any]) -> object:
    """Inverse of dumps_frames, from the frames received (bytes, or zmq.Frame with copy=False)."""
    views = [f.buffer if hasattr(f, "buffer") else f for f in frames]
    return pickle.loads(views[0], buffers=views[1:])
