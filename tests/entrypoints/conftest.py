"""One live server shared by the control-plane test modules (test_colocated_control.py,
test_control_faults.py): fake Qwen3-MoE, R3 on, GPU prefix cache only (memory release needs no CPU or
storage tier), and short deadlines — a worker gives up a rendezvous or a broadcast after
WORKER_DEADLINE_S while the API server's stall watchdog would kill an engine silent for STALL_S, so every
test that survives a stalled control call also proves that the engine heartbeats through it. The control
fault tests wait the worker deadline out, so it is only a little longer than the stall deadline; the stall
deadline itself stays at 10 s, because a weight load on a loaded 2-core machine keeps the engine from
answering for several seconds (5 s was seen to kill it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from api_server_process import ServerHandle, api_server

WORKER_DEADLINE_S = 12.0
STALL_S = 10.0


@pytest.fixture(scope="session")
def control_server(fake_model_dir, tmp_path_factory) -> Iterator[ServerHandle]:
    with api_server(fake_model_dir("qwen3_moe", seed=0), str(tmp_path_factory.mktemp("control_logs")),
                    "--routing-replay-config", '{"enable_routing_replay": true}', "--max-model-len", "256",
                    "--num-gpu-blocks-override", "64", "--worker-step-timeout-s", str(WORKER_DEADLINE_S),
                    "--engine-stall-timeout-s", str(STALL_S)) as handle:
        yield handle


@pytest.fixture(scope="session")
def control_stall_s() -> float:
    """The control server's stall deadline: a probe later than this proves the engine heartbeated."""
    return STALL_S
