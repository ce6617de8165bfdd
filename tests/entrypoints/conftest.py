"""One live server shared by the control-plane test modules (test_colocated_control.py,
test_control_faults.py): fake Qwen3-MoE, R3 on, GPU prefix cache only (memory release needs no CPU or
storage tier), and short deadlines — a worker gives up a rendezvous or a broadcast after 15 s while the
API server's stall watchdog would kill an engine silent for 10 s, so every test that survives a stalled
control call also proves that the engine heartbeats through it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from api_server_process import ServerHandle, api_server


@pytest.fixture(scope="session")
def control_server(fake_model_dir, tmp_path_factory) -> Iterator[ServerHandle]:
    with api_server(fake_model_dir("qwen3_moe", seed=0), str(tmp_path_factory.mktemp("control_logs")),
                    "--routing-replay-config", '{"enable_routing_replay": true}', "--max-model-len", "256",
                    "--num-gpu-blocks-override", "64", "--worker-step-timeout-s", "15",
                    "--engine-stall-timeout-s", "10") as handle:
        yield handle
