"""SGLang's expert distribution record routes (GET or POST, plain-text answers as SGLang gives them):

    /start_expert_distribution_record   forget earlier counts, count from the next step on
    /stop_expert_distribution_record    stop counting (the counts stay)
    POST /rebalance_experts             EPLB from the record: JSON {"success", "message", "physical_to_logical"}
    /dump_expert_distribution_record    write the counts to $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR (default
                                        /tmp) as expert_distribution_recorder_<unix time>.pt:
                                        {"rank": 0, "logical_count": int64 tensor [L, E]}

logical_count[l, e] is the number of (token, k) rows MoE layer l routed to LOGICAL expert e (the ids R3
records) over every forward pass since the start (model_executor/layers/expert_load.py). A failure is
the control routes' JSON answer (entrypoints/native/control_api.py) with its status.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from fastdeploy_r3.engine.messages import (
    ControlCommand,
    ControlReply,
    ExpertDistributionRecord,
    ExpertLoadReport,
    ExpertPlacementReport,
    ExpertRebalance,
)

RECORDER_DIR_ENV = "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"


def dump_path(now: float | None = None) -> str:
    """Where the next dump goes (SGLang's directory variable and file name)."""
    directory = os.environ.get(RECORDER_DIR_ENV) or "/tmp"
    return os.path.join(directory, f"expert_distribution_recorder_{time.time() if now is None else now}.pt")


def add_expert_distribution_routes(app: FastAPI, control: Callable[[ControlCommand], Awaitable[ControlReply]],
                                   answer: Callable[..., JSONResponse]) -> None:  # fmt: skip
    async def run(action: str, text: str) -> Response:
        reply = await control(ExpertDistributionRecord(action))
        if not reply.success:
            return answer(reply)
        if isinstance(reply.report, ExpertLoadReport):
            import torch

            path = dump_path()
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save({"rank": 0, "logical_count": torch.tensor(reply.report.logical_count, dtype=torch.int64)},
                       path)
        return PlainTextResponse(text)

    @app.api_route("/start_expert_distribution_record", methods=["GET", "POST"])
    async def start_expert_distribution_record() -> Response:
        return await run("start", "Start recording the expert distribution.\n")

    @app.api_route("/stop_expert_distribution_record", methods=["GET", "POST"])
    async def stop_expert_distribution_record() -> Response:
        return await run("stop", "Stop recording the expert distribution.\n")

    @app.api_route("/dump_expert_distribution_record", methods=["GET", "POST"])
    async def dump_expert_distribution_record() -> Response:
        return await run("dump", "Dump expert distribution record.\n")

    @app.post("/rebalance_experts")
    async def rebalance_experts() -> JSONResponse:
        reply = await control(ExpertRebalance())
        if not isinstance(reply.report, ExpertPlacementReport):
            return answer(reply)
        return answer(reply, physical_to_logical=reply.report.physical_to_logical)
