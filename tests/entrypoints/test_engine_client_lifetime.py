"""The API server's engine client: a reader task that dies fails every request at once (instead of
hanging them all) and reports the engine lost; a stopped engine is killed past the stall deadline."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import pytest

from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.entrypoints import engine_client
from fastdeploy_r3.entrypoints.engine_client import AsyncEngineClient
from fastdeploy_r3.lifecycle import EngineDeadError
from fastdeploy_r3.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def config(fake_model_dir: Callable[..., str]) -> EngineConfig:
    return EngineConfig.from_kwargs(fake_model_dir("qwen3_moe"), block_size=4, num_gpu_blocks_override=32,
                                    device="cpu")


def test_a_dead_reader_fails_in_flight_requests_and_reports_the_engine_lost(config, monkeypatch) -> None:
    async def scenario() -> tuple[str, list[str], float]:
        client = await AsyncEngineClient.start(config)
        lost: list[str] = []
        client.on_dead = lost.append

        def poisoned(frames: object) -> object:
            raise ValueError("a message that does not unpickle")

        monkeypatch.setattr(engine_client, "loads_frames", poisoned)  # the reader's next message kills it
        t0 = time.monotonic()
        try:
            gen = client.generate("r1", [20, 21, 22], SamplingParams(max_tokens=50, ignore_eos=True))
            with pytest.raises(EngineDeadError) as err:
                async with asyncio.timeout(30):
                    async for _ in gen:
                        pass
            return str(err.value), lost, time.monotonic() - t0
        finally:
            monkeypatch.undo()
            await client.shutdown()

    message, lost, seconds = asyncio.run(scenario())
    assert message.startswith("the server's fdr3-engine-reader task stopped (ValueError: a message that does not")
    assert lost == [message] and seconds < 30


def test_a_stopped_engine_is_killed_past_the_stall_deadline(config) -> None:
    async def scenario() -> tuple[str, float, int]:
        client = await AsyncEngineClient.start(config, stall_timeout_s=3.0)
        lost: list[str] = []
        client.on_dead = lost.append
        pid = client.info.pid
        try:
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            gen = client.generate("r1", [20, 21, 22], SamplingParams(max_tokens=5))
            with pytest.raises(EngineDeadError) as err:
                async with asyncio.timeout(30):
                    async for _ in gen:
                        pass
            return str(err.value), time.monotonic() - t0, pid
        finally:
            await client.shutdown()

    message, seconds, pid = asyncio.run(scenario())
    assert message.startswith(f"engine process (pid {pid}) did not answer for ")
    assert "stopped or stuck past stall_timeout_s=3" in message
    assert 2.5 < seconds < 15
