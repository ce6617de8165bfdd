"""What a server says about itself: SGLang's info endpoints with this server's true values, and the
one redaction every info answer goes through (/v1/models too).

    GET /server_info, /get_server_info   SGLang's ServerArgs names (the fields slime's and miles'
                                         external-engine checks compare) + live state
    GET /model_info, /get_model_info     the model, under SGLang's names and ours
    GET /v1/loads                        running / waiting requests per data-parallel rank, as SGLang
                                         answers it (slime's idle check after an abort reads it)
    GET /health_generate                 one greedy token through the engine (SGLang's deep check)

A single process serves one data-parallel rank on one node, its ranks on consecutive devices from
0: nnodes 1, node_rank 0, dp_size 1, pp_size 1, base_gpu_id 0, gpu_id_step 1.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from fastdeploy_r3.blobstore.base import redact_url
from fastdeploy_r3.engine.messages import EngineStateQuery
from fastdeploy_r3.entrypoints.engine_client import EngineRequestError
from fastdeploy_r3.entrypoints.openai.serving_engine import ServingContext, engine_unavailable
from fastdeploy_r3.lifecycle import EngineDeadError
from fastdeploy_r3.sampling_params import SamplingParams

HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's deadline for its one-token check

# keys whose values are server paths or secrets: never in an answer, whatever nests them
_PRIVATE_KEYS = frozenset({"local_store_dir", "api_key", "kv_storage_dir"})


def redacted(value: Any) -> Any:
    """`value` fit for a client: private keys dropped, URL passwords masked, a file URL's path hidden.

    The one rule of every info endpoint (/server_info, /model_info, /v1/models)."""
    if isinstance(value, dict):
        return {k: redacted(v) for k, v in value.items() if k not in _PRIVATE_KEYS}
    if isinstance(value, (list, tuple)):
        return [redacted(v) for v in value]
    if isinstance(value, str) and "://" in value:
        return "file://***" if value.startswith("file://") else redact_url(value)
    return value


_PATH = re.compile(r"(?<![\w:/.~-])/[^\s'\":,;()\]\[]+")


def scrub_paths(message: str) -> str:
    """A message without the server's file paths (a store directory in a degraded store's error)."""
    return _PATH.sub("<path>", message)


@dataclass(frozen=True)
class ServerAddress:
    host: str
    port: int


def server_args(ctx: ServingContext, address: ServerAddress) -> dict[str, Any]:
    """This server's settings under SGLang's ServerArgs names (the static part of /server_info)."""
    cfg = ctx.engine.config
    mc, cc, sc, pc, rr = (cfg.model_config, cfg.cache_config, cfg.scheduler_config, cfg.parallel_config,
                          cfg.routing_replay_config)  # fmt: skip
    return {
        "model_path": mc.model, "tokenizer_path": mc.tokenizer or mc.model, "served_model_name": ctx.served_model_name,
        "host": address.host, "port": address.port, "nnodes": 1, "node_rank": 0, "dist_init_addr": None,
        "base_gpu_id": 0, "gpu_id_step": 1, "tp_size": pc.tensor_parallel_size, "dp_size": 1, "pp_size": 1,
        "ep_size": getattr(pc, "expert_parallel_size", 1), "moe_dp_size": 1,
        "ep_num_redundant_experts": getattr(pc, "ep_num_redundant_experts", 0),
        # SGLang's spelling: "none" is its name for no all-to-all (our local dispatch)
        "moe_a2a_backend": "none" if pc.moe_a2a_backend == "local" else pc.moe_a2a_backend,
        "device": cfg.device, "dtype": mc.dtype, "load_format": mc.load_format, "context_length": mc.max_model_len,
        "page_size": cc.block_size, "disable_radix_cache": not cc.enable_prefix_caching,
        "max_running_requests": sc.max_num_seqs, "chunked_prefill_size":
        sc.max_num_batched_tokens if sc.enable_chunked_prefill else -1,
        "random_seed": mc.seed, "skip_server_warmup": True, "encoder_only": False,
        # prefill/decode disaggregation (entrypoints/pd/): the router reads the mode, D the bootstrap port
        "disaggregation_mode": ctx.pd.mode if ctx.pd is not None else "null",
        "disaggregation_bootstrap_port": ctx.pd.bootstrap_port if ctx.pd is not None else None,
        "disaggregation_transfer_backend": ctx.pd.transfer_backend if ctx.pd is not None else None,
        "enable_memory_saver": ctx.enable_memory_saver,
        # SGLang returns R3 only from a server started with this flag; here R3 on is enough, and
        # --enable-return-routed-experts makes it the default of every /generate
        "enable_return_routed_experts": rr.enable_routing_replay,
        "return_routed_experts_by_default": ctx.enable_return_routed_experts,
        "max_n": ctx.bounds.max_n, "max_batch_size": ctx.bounds.max_batch_size,
        "api_key": None,
    }


def add_info_routes(app: FastAPI, ctx: ServingContext, address: ServerAddress) -> None:
    async def engine_state():
        try:
            return (await ctx.engine.control(EngineStateQuery(), timeout_s=10.0)).state
        except (EngineDeadError, TimeoutError) as e:
            raise engine_unavailable(str(e) or "the engine did not answer within 10 s") from e

    async def server_info() -> JSONResponse:
        cfg = ctx.engine.config
        state = await engine_state()
        live = {
            "weight_version": state.weight_version, "paused": state.paused is not None, "pause_mode": state.paused,
            "num_requests": state.num_requests, "max_model_len": ctx.engine.info.max_model_len,
            "block_size": cfg.cache_config.block_size, "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
            "routing_replay_config": json.loads(cfg.routing_replay_config.to_json()),
            "internal_states": [{"weight_version": state.weight_version, "num_requests": state.num_requests}],
            "version": _version(),
        }
        return JSONResponse(redacted({**server_args(ctx, address), **live}))

    async def model_info() -> JSONResponse:
        mc, rr = ctx.engine.config.model_config, ctx.engine.config.routing_replay_config
        state = await engine_state()
        return JSONResponse(redacted({
            "model_path": mc.model, "tokenizer_path": mc.tokenizer or mc.model, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": state.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False, "model_type": mc.hf_config.get(
                "model_type"), "architectures": [mc.architecture], "architecture": mc.architecture,
            "num_hidden_layers": mc.num_hidden_layers, "moe_layer_ids": list(mc.moe_layer_ids),
            "num_experts": mc.num_experts, "moe_top_k": mc.moe_top_k, "routing_replay": rr.enable_routing_replay,
        }))

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model_info, methods=["GET"])

    @app.get("/v1/loads")
    async def loads(include: str | None = None) -> JSONResponse:
        """SGLang's shape: one entry per data-parallel rank (here one) and their aggregate."""
        try:
            m = await ctx.engine.metrics(10.0)
        except (EngineDeadError, TimeoutError) as e:
            raise engine_unavailable(str(e) or "the engine did not answer within 10 s") from e
        block_size = ctx.engine.config.cache_config.block_size
        total = int(m["num_gpu_blocks"]) * block_size
        used = (int(m["num_gpu_blocks"]) - int(m["num_free_gpu_blocks"])) * block_size
        waiting = int(m["num_waiting"]) + int(m.get("num_loading", 0))  # LOADING: admitted, its KV still arriving
        rank = {
            "dp_rank": 0, "num_running_reqs": int(m["num_running"]), "num_waiting_reqs": waiting,
            "num_used_tokens": used, "max_total_num_tokens": total, "token_usage": used / total if total else 0.0,
        }
        aggregate = {k: rank[k] for k in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens")}
        return JSONResponse({"timestamp": time.time(), "version": _version(), "dp_rank_count": 1, "loads": [rank],
                             "aggregate": {**aggregate, "num_total_reqs": rank["num_running_reqs"]
                                           + rank["num_waiting_reqs"]}})

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        """200 once one greedy token came back through scheduler, workers and token processor; 503 when
        the engine is dead or it did not within 20 s. While paused nothing can run: 200, `paused`."""
        state = await engine_state()
        if state.paused is not None:
            return JSONResponse({"status": "paused", "pause_mode": state.paused})
        request_id = f"health-generate-{uuid.uuid4().hex}"
        params = SamplingParams(max_tokens=1, temperature=0.0, return_routed_experts=False)
        try:
            async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
                async for delta in ctx.engine.generate(request_id, [0], params, None):
                    if delta.finished:
                        errors = [c.error for c in delta.outputs if c.finish_reason == "error"]
                        if errors:
                            raise EngineRequestError(errors[0] or "the health generation failed")
                        break
        except (EngineDeadError, EngineRequestError, TimeoutError) as e:
            reason = str(e) or f"no token within {HEALTH_GENERATE_TIMEOUT_S:g} s"
            return JSONResponse(engine_unavailable(f"health generation failed: {reason}").body(), status_code=503)
        return JSONResponse({"status": "ok"})


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fastdeploy_r3")
    except PackageNotFoundError:
        return "0+unknown"
