"""Routes of the colocated-training and weight-version control calls (slime's and miles' paths):

    POST /update_weights_from_tensor    {"serialized_named_tensors": [one per TP rank], "load_format", ...}
    POST /release_memory_occupation     {"tags": ["kv_cache", "weights"] | null}
    POST /resume_memory_occupation      {"tags": ...}
    POST /update_weight_version         {"new_version", "abort_all_requests"}
    GET|POST /weights_checker           {"action": "checksum" | "snapshot" | "compare", ...}
    POST /begin_weight_update, /end_weight_update, /post_process_weights
    GET /check_integrity                the KV cache's books agree, and nothing is reserved while idle

Answers are SGLang's `{"success", "message"}` plus the engine's weight_version and pause state; 200,
400 (refused, nothing changed), 409 (not now: requests in flight, memory released), 500 (failed),
503 (the engine is gone).

`selector` (miles) picks which of an engine's models a call applies to; this engine has one model
and no draft model, so "all" is honoured and anything else is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from fastdeploy_r3.engine.messages import (
    CheckIntegrity,
    ControlCommand,
    ControlReply,
    EngineStateQuery,
    IntegrityReport,
    MemoryReport,
    ReleaseMemoryOccupation,
    ResumeMemoryOccupation,
    UpdateWeightVersion,
    WeightsCheck,
    WeightsReport,
    WeightUpdate,
    WeightUpdateSession,
)
from fastdeploy_r3.entrypoints.native.control_protocol import (
    BeginWeightUpdateRequest,
    EndWeightUpdateRequest,
    MemoryOccupationRequest,
    PostProcessWeightsRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    WeightsCheckerRequest,
)
from fastdeploy_r3.entrypoints.native.expert_record_api import add_expert_distribution_routes
from fastdeploy_r3.entrypoints.openai.serving_engine import ServingContext, bad_request, engine_unavailable
from fastdeploy_r3.lifecycle import EngineDeadError
from fastdeploy_r3.worker.messages import UpdateWeights

SELECTORS = ("all",)


def check_selector(selector: str) -> None:
    if selector not in SELECTORS:
        raise bad_request(f"selector {selector!r} is not supported: this engine serves one model and no draft "
                          f"model; send 'all'", "selector")


def control_answer(reply: ControlReply, **extra: Any) -> JSONResponse:
    body = {"success": reply.success, "message": reply.message, "weight_version": reply.state.weight_version,
            "paused": reply.state.paused is not None, **extra}
    status = reply.status or (200 if reply.success else (400 if reply.invalid else 500))
    return JSONResponse(body, status_code=status)


def add_control_routes(app: FastAPI, ctx: ServingContext) -> None:
    async def control(command: ControlCommand) -> ControlReply:
        try:
            return await ctx.engine.control(command)
        except EngineDeadError as e:
            raise engine_unavailable(str(e)) from e

    add_expert_distribution_routes(app, control, control_answer)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: UpdateWeightsFromTensorRequest) -> JSONResponse:
        check_selector(body.selector)
        if body.disable_draft_model:
            raise bad_request("disable_draft_model: this engine has no draft model; leave it out",
                              "disable_draft_model")
        tp = ctx.engine.config.parallel_config.tensor_parallel_size
        if len(body.serialized_named_tensors) != tp:
            raise bad_request(f"serialized_named_tensors has {len(body.serialized_named_tensors)} entries; send one "
                              f"per TP rank ({tp})", "serialized_named_tensors")
        source = UpdateWeights(serialized_named_tensors=list(body.serialized_named_tensors),
                               load_format=body.load_format)
        return control_answer(await control(WeightUpdate(source, body.weight_version, body.abort_all_requests,
                                                         body.force)))

    def memory_answer(reply: ControlReply) -> JSONResponse:
        report = reply.report
        if not isinstance(report, MemoryReport):
            return control_answer(reply)
        ranks = [{"rank": r, "bytes": n, "memory_allocated_before": b, "memory_allocated_after": a}
                 for r, (n, b, a) in enumerate(zip(report.nbytes, report.allocated_before, report.allocated_after))]
        return control_answer(reply, ranks=ranks)

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(body: MemoryOccupationRequest | None = None) -> JSONResponse:
        return memory_answer(await control(ReleaseMemoryOccupation((body or MemoryOccupationRequest()).tags)))

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(body: MemoryOccupationRequest | None = None) -> JSONResponse:
        return memory_answer(await control(ResumeMemoryOccupation((body or MemoryOccupationRequest()).tags)))

    @app.post("/update_weight_version")
    async def update_weight_version(body: UpdateWeightVersionRequest) -> JSONResponse:
        return control_answer(await control(UpdateWeightVersion(body.new_version, body.abort_all_requests)))

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    async def weights_checker(body: WeightsCheckerRequest | None = None) -> JSONResponse:
        body = body or WeightsCheckerRequest()
        check_selector(body.selector)
        reply = await control(WeightsCheck(body.action, list(body.skip_tensor_list or [])))
        report = reply.report if isinstance(reply.report, WeightsReport) else None
        extra: dict[str, Any] = {"algorithm": "sha256 of each parameter's bytes per TP rank; engine checksum: sha256 "
                                              "of the sorted rank|name|digest lines"}
        if report is not None:
            extra.update(ranks=[{"rank": r, "checksums": c} for r, c in enumerate(report.checksums)],
                         per_engine_checksum=report.engine_checksum, mismatched=report.mismatched)
        return control_answer(reply, **extra)

    @app.get("/check_integrity")
    async def check_integrity() -> JSONResponse:
        reply = await control(CheckIntegrity())
        report = reply.report if isinstance(reply.report, IntegrityReport) else None
        extra = {} if report is None else {"num_requests": report.num_requests, "num_blocks": report.num_blocks,
                                           "num_referenced_blocks": report.num_referenced_blocks}
        return control_answer(reply, **extra)

    @app.post("/begin_weight_update")
    async def begin_weight_update(body: BeginWeightUpdateRequest | None = None) -> JSONResponse:
        check_selector((body or BeginWeightUpdateRequest()).selector)
        return control_answer(await control(WeightUpdateSession(begin=True)))

    @app.post("/end_weight_update")
    async def end_weight_update(body: EndWeightUpdateRequest | None = None) -> JSONResponse:
        return control_answer(await control(WeightUpdateSession(begin=False)))

    @app.post("/post_process_weights")
    async def post_process_weights(body: PostProcessWeightsRequest | None = None) -> JSONResponse:
        body = body or PostProcessWeightsRequest()
        check_selector(body.selector)
        state = (await control(EngineStateQuery())).state
        return JSONResponse({
            "success": True,
            "message": "nothing to post-process: this engine loads weights in their serving layout (an fp8 engine "
                       "quantizes each float weight as it arrives), so restore_weights_before_load and "
                       "post_process_quantization have no work (no-op)",
            "weight_version": state.weight_version, "paused": state.paused is not None,
        })
