"""OpenAI-compatible HTTP server in front of the engine process.

    python -m fastdeploy_r3.entrypoints.openai.api_server --model DIR \\
        --routing-replay-config '{"enable_routing_replay": true}' --port 8000 [--api-key K]

Start-up order: parse and validate the config (a bad flag exits with a message before anything
starts), reach the routing store, bind the port, start the engine process, then serve. The engine
process is shut down when the server stops (SIGINT/SIGTERM included). When the engine dies or stalls,
the server answers what is in flight with the error, logs why, and exits with code 1, so that its
supervisor (systemd, Kubernetes) restarts the whole tree instead of a server that answers 503 forever.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastdeploy_r3.blob_store import redact_url
from fastdeploy_r3.config import ConfigError, EngineConfig
from fastdeploy_r3.entrypoints.engine_client import AsyncEngineClient, EngineStartupError
from fastdeploy_r3.entrypoints.openai.metrics import render_metrics
from fastdeploy_r3.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from fastdeploy_r3.entrypoints.openai.serving_chat import OpenAIServingChat
from fastdeploy_r3.entrypoints.openai.serving_completion import OpenAIServingCompletion
from fastdeploy_r3.entrypoints.openai.serving_engine import OpenAIError, ServingContext, engine_unavailable
from fastdeploy_r3.lifecycle import EngineDeadError
from fastdeploy_r3.r3.rollout_id import validate_rollout_id
from fastdeploy_r3.r3.stores import RedisRoutingStore, RoutingStore, RoutingStoreError, make_routing_store

logger = logging.getLogger("fastdeploy_r3.api_server")

_HEALTH_TIMEOUT_S = 10.0


def make_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description="fastdeploy_r3 OpenAI-compatible server")
    EngineConfig.add_cli_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key", default=os.environ.get("FDR3_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $FDR3_API_KEY, else no key)",
    )
    parser.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    parser.add_argument(
        "--r3-namespace", default="fdr3",
        help="key prefix of this deployment in the R3 p2pstore: keys are {namespace}:{rollout_id}[:{layer}]",
    )
    parser.add_argument("--engine-start-timeout", type=float, default=900.0)
    parser.add_argument(
        "--engine-stall-timeout-s", type=float, default=None,
        help="an engine silent this long (stopped, stuck) is killed and the server exits "
             "(default: --worker-step-timeout-s + 30)",
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return parser


def _model_card(ctx: ServingContext, store: RoutingStore | None, namespace: str) -> ModelCard:
    cfg = ctx.engine.config
    rr = cfg.routing_replay_config
    r3 = {
        "enabled": rr.enable_routing_replay,
        "moe_layer_ids": list(rr.moe_layer_ids or []),
        "num_experts": rr.num_experts,
        "moe_top_k": rr.moe_top_k,
        "routing_dtype": None if rr.routing_dtype is None else str(rr.routing_dtype),
        "routing_store_type": rr.routing_store_type,
        "use_fused_put": rr.use_fused_put,
        "only_last_turn": rr.only_last_turn,
        "debug_mode": rr.debug_mode,
        "namespace": namespace if isinstance(store, RedisRoutingStore) else None,
        "p2pstore_url": redact_url(rr.p2pstore_url) if rr.p2pstore_url else None,
        "local_store_dir": os.path.abspath(rr.local_store_dir) if rr.local_store_dir else None,
        "block_size": cfg.cache_config.block_size,
    }
    return ModelCard(id=ctx.served_model_name, root=cfg.model_config.model, max_model_len=ctx.engine.info.max_model_len,
                     r3=r3)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {err.get('msg')}", None
        if not loc and err.get("type") in ("model_attributes_type", "dict_type"):
            return "the request body must be a JSON object (send Content-Type: application/json)", None
        param = param or (".".join(loc) or None)
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request", param


def build_app(ctx: ServingContext, api_key: str | None, namespace: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn re-raises SIGTERM/SIGINT after serving; shut the engine down before that
        await ctx.engine.shutdown()

    app = FastAPI(title="fastdeploy_r3", lifespan=lifespan)
    completion = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            auth = request.headers.get("authorization", "")
            if not secrets.compare_digest(auth.encode(), f"Bearer {api_key}".encode()):
                err = OpenAIError(401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                                  "authentication_error")
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    @app.exception_handler(OpenAIError)
    async def on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(OpenAIError(400, message, "invalid_request_error", param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(OpenAIError(exc.status_code, str(exc.detail), kind).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        err = OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_server_error")
        return JSONResponse(err.body(), status_code=500)

    async def health_body() -> tuple[dict[str, str], bool]:
        """({"status", "engine", and per degraded part why}, can R3 be delivered); EngineDeadError."""
        body = {"status": "ok", "engine": "ok"}
        body.update(await ctx.engine.check_health(_HEALTH_TIMEOUT_S))
        r3_problem = await asyncio.to_thread(ctx.delivery.store_problem)
        if r3_problem is not None:
            body["r3_store"] = r3_problem
        if len(body) > 2:
            body["status"] = "degraded"
        return body, r3_problem is None

    @app.get("/health")
    async def health() -> Response:
        """Liveness: 200 while the engine answers, with what is degraded (a store down) in the body."""
        try:
            body, _ = await health_body()
        except EngineDeadError as e:
            return JSONResponse(engine_unavailable(str(e)).body(), status_code=503)
        return JSONResponse(body)

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: 200 only while the server can serve requests and deliver their R3 (503 otherwise)."""
        try:
            body, r3_ok = await health_body()
        except EngineDeadError as e:
            return JSONResponse(engine_unavailable(str(e)).body(), status_code=503)
        return JSONResponse(body, status_code=200 if r3_ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        engine_metrics: dict[str, float] | None = None
        if ctx.engine.is_alive:
            with contextlib.suppress(EngineDeadError, TimeoutError):
                engine_metrics = await ctx.engine.metrics(_HEALTH_TIMEOUT_S)
        body, content_type = render_metrics(engine_metrics, ctx.counters)
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=[_model_card(ctx, ctx.store, namespace)]).model_dump())

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest) -> Response:
        return await completion.create_completion(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest) -> Response:
        return await chat.create_chat_completion(request)

    return app


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class EngineLostError(RuntimeError):
    """The engine died or stalled while serving; the server exits non-zero so a supervisor restarts it."""


async def run_server(args: argparse.Namespace) -> None:
    config = EngineConfig.from_cli_args(args)  # ConfigError: bad flags, before anything starts
    namespace = validate_rollout_id(args.r3_namespace, "--r3-namespace")
    store = make_routing_store(config.routing_replay_config, namespace)
    if isinstance(store, RedisRoutingStore):
        store.ping()
    from fastdeploy_r3.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.model_config.tokenizer or config.model_config.model)
    sock = _bind(args.host, args.port)  # fail on a taken port before the (slow) engine start
    # until uvicorn installs its handlers, SIGTERM must unwind through the finally below
    signal.signal(signal.SIGTERM, _raise_system_exit)
    engine: AsyncEngineClient | None = None
    lost: list[str] = []
    try:
        engine = await AsyncEngineClient.start(config, tokenizer, timeout_s=args.engine_start_timeout,
                                               stall_timeout_s=args.engine_stall_timeout_s)
        ctx = ServingContext(engine=engine, served_model_name=args.served_model_name or args.model, store=store)
        app = build_app(ctx, args.api_key, namespace)
        server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=10))

        def on_engine_dead(message: str) -> None:
            # in-flight requests already got the error; uvicorn lets their responses finish, then exits
            logger.error("the engine is gone (%s); the server exits with code 1 so that its supervisor restarts it",
                         message)
            lost.append(message)
            server.should_exit = True

        engine.on_dead = on_engine_dead
        logger.info("serving %s on http://%s:%d", ctx.served_model_name, args.host, args.port)
        await server.serve(sockets=[sock])
        if lost:
            raise EngineLostError(f"the engine is gone ({lost[0]}); exiting with code 1 so that a supervisor "
                                  "restarts the server")
    finally:
        if engine is not None:
            await engine.shutdown()
        if store is not None:
            store.close()
        sock.close()


def main(argv: list[str] | None = None) -> None:
    args = make_arg_parser().parse_args(argv)
    serve(args)


def serve(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(run_server(args))
    except (ConfigError, EngineStartupError, EngineLostError, RoutingStoreError, ValueError, OSError) as e:
        # start-up failures: one clear line (plus the engine's traceback where it sent one), exit 1
        print(f"fastdeploy_r3: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
