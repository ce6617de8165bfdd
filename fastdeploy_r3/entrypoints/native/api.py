"""Routes of the SGLang-compatible native API, beside the OpenAI ones on the same server.

    POST /generate                           rollouts (serving_generate.py)
    GET|POST /flush_cache                    forget every cached prefix (GPU pool, CPU tier)
    POST /abort_request                      {"rid"} or {"abort_all": true}
    POST /pause_generation                   {"mode": "abort" | "in_place" | "retract"}
    POST /continue_generation
    POST /update_weights_from_disk           {"model_path", "weight_version", "abort_all_requests", ...}
    POST /init_weights_update_group          {"master_address", "master_port", "rank_offset", "world_size",
                                              "group_name", "backend"}
    POST /update_weights_from_distributed    {"names", "dtypes", "shapes", "group_name", "weight_version", ...}
    POST /destroy_weights_update_group       {"group_name"}
    GET  /get_weight_version
    (info endpoints, /v1/loads and /health_generate: server_info.py)
    and the colocated-training / version calls of control_api.py

Control answers are SGLang's `{"success": bool, "message": str}` (plus the engine's weight_version
and pause state), status 200 on success, 400 when the command was refused, 500 when it failed.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from fastdeploy_r3.engine.messages import (
    ContinueGeneration,
    ControlCommand,
    ControlReply,
    EngineStateQuery,
    FlushCache,
    PauseGeneration,
    WeightUpdate,
)
from fastdeploy_r3.entrypoints.native.control_api import add_control_routes, check_selector, control_answer
from fastdeploy_r3.entrypoints.native.protocol import (
    AbortRequestBody,
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
)
from fastdeploy_r3.entrypoints.native.serving_generate import NativeServing
from fastdeploy_r3.entrypoints.openai.disconnect import unless_gone
from fastdeploy_r3.entrypoints.openai.serving_engine import ServingContext, bad_request, engine_unavailable
from fastdeploy_r3.lifecycle import EngineDeadError
from fastdeploy_r3.worker.messages import DestroyWeightUpdateGroup, InitWeightUpdateGroup, UpdateWeights


def add_native_routes(app: FastAPI, ctx: ServingContext) -> None:
    serving = NativeServing(ctx)

    async def control(command: ControlCommand) -> ControlReply:
        try:
            return await ctx.engine.control(command)
        except EngineDeadError as e:
            raise engine_unavailable(str(e)) from e

    answer = control_answer
    add_control_routes(app, ctx)

    @app.post("/generate")
    async def generate(body: GenerateRequest, raw: Request) -> Response:
        return await unless_gone(raw, serving.generate(body))  # a client that hangs up aborts its rollout

    @app.api_route("/flush_cache", methods=["GET", "POST"])  # SGLang takes both
    async def flush_cache() -> JSONResponse:
        return answer(await control(FlushCache()))

    @app.post("/abort_request")
    async def abort_request(body: AbortRequestBody) -> JSONResponse:
        if body.abort_all:
            rids = ctx.engine.in_flight_request_ids()
        elif body.rid:
            rids = [body.rid]
        else:
            raise bad_request("send the rid of the request to abort, or abort_all: true", "rid")
        for rid in rids:
            await ctx.engine.abort(rid, "aborted by /abort_request")
        return JSONResponse({"success": True, "message": f"abort sent for {len(rids)} request(s)"})

    @app.post("/pause_generation")
    async def pause_generation(body: PauseGenerationRequest) -> JSONResponse:
        return answer(await control(PauseGeneration(body.mode)))

    @app.post("/continue_generation")
    async def continue_generation(body: ContinueGenerationRequest | None = None) -> JSONResponse:
        return answer(await control(ContinueGeneration()))

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> JSONResponse:
        check_load_format(body.load_format)
        update = WeightUpdate(UpdateWeights(model_path=body.model_path), body.weight_version, body.abort_all_requests,
                              body.force)
        reply = await control(update)
        return answer(reply, num_paused_requests=reply.state.num_requests)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest) -> JSONResponse:
        tp = ctx.engine.config.parallel_config.tensor_parallel_size
        if body.rank_offset + tp > body.world_size:
            raise bad_request(f"rank_offset {body.rank_offset} + this engine's {tp} ranks exceed world_size "
                              f"{body.world_size}", "world_size")
        return answer(await control(InitWeightUpdateGroup(
            body.master_address, body.master_port, body.rank_offset, body.world_size, body.group_name, body.backend,
        )))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest) -> JSONResponse:
        check_load_format(body.load_format)
        check_selector(body.selector)
        source = UpdateWeights(group_name=body.group_name, names=body.names, dtypes=body.dtypes, shapes=body.shapes)
        return answer(await control(WeightUpdate(source, body.weight_version, body.abort_all_requests, body.force)))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupRequest) -> JSONResponse:
        return answer(await control(DestroyWeightUpdateGroup(body.group_name)))

    @app.get("/get_weight_version")
    async def get_weight_version() -> JSONResponse:
        return JSONResponse({"weight_version": (await control(EngineStateQuery())).state.weight_version})


def check_load_format(load_format: str | None) -> None:
    if load_format not in (None, "auto", "safetensors"):
        raise bad_request(f"load_format {load_format!r} is not supported; weights load as safetensors", "load_format")
