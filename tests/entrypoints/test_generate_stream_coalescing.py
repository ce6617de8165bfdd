"""/generate's streamed chunks are cumulative (SGLang's), so a chunk whose successor is already waiting
adds nothing: when the client (or the API process) falls behind the engine, the stream skips it.

Story: a request of 6 tokens, one per delta. Tokens 10 and 11 come one at a time, each read at once:
a chunk each. Then the consumer stalls while the deltas of 12, 13 and 14 pile up in the request's
queue: when it reads again it gets one chunk holding 10-14 (not three chunks), then the final
answer with all 6.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

from fastdeploy_r3.entrypoints.native.serving_generate import NativeServing, _Item
from fastdeploy_r3.outputs import CompletionDelta, RequestDelta
from fastdeploy_r3.sampling_params import SamplingParams


def delta(token: int, finished: bool = False) -> RequestDelta:
    out = CompletionDelta(0, f"t{token}", [token], finish_reason="length" if finished else None)
    return RequestDelta("req", [out], finished, prompt_token_ids=[1, 2, 3] if token == 10 else None)


async def stream_with_a_stalled_reader() -> list[dict]:
    queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
    queue.put_nowait(delta(10))
    engine = SimpleNamespace(queued=lambda request_id: queue.qsize(), tokenizer=None)
    serving = NativeServing.__new__(NativeServing)
    serving.ctx = SimpleNamespace(engine=engine, counters=SimpleNamespace(generate_requests=0, request_errors=0))

    async def routed_experts(item, final):  # noqa: ANN001, ANN202 - R3 is not what this story is about
        return [None]

    serving.routed_experts = routed_experts

    async def rest():  # noqa: ANN202
        while True:
            d = await queue.get()
            yield d
            if d.finished:
                return

    first = await queue.get()
    item = _Item("req", [1, 2, 3], None, SamplingParams(max_tokens=6), False, False, stream_interval=1)
    body = SimpleNamespace(log_metrics=True)
    gen = serving._stream(body, item, first, rest(), time.monotonic())
    lines = [await gen.__anext__()]  # token 10
    queue.put_nowait(delta(11))
    lines.append(await gen.__anext__())
    for token in (12, 13, 14):  # the reader is busy elsewhere
        queue.put_nowait(delta(token))
    lines.append(await gen.__anext__())
    queue.put_nowait(delta(15, finished=True))
    lines += [line async for line in gen]
    # the last chunk comes as bytes (its R3 payload is spliced in from the encoder's buffer), the others as text
    lines = [line.decode() if isinstance(line, bytes) else line for line in lines]
    chunks = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    assert lines[-1] == "data: [DONE]\n\n"
    return chunks


def test_a_reader_that_falls_behind_gets_one_cumulative_chunk_for_what_piled_up() -> None:
    chunks = asyncio.run(stream_with_a_stalled_reader())
    assert [c["output_ids"] for c in chunks] == [[10], [10, 11], [10, 11, 12, 13, 14], [10, 11, 12, 13, 14, 15]]
    assert chunks[-1]["text"] == "t10t11t12t13t14t15" and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
