"""OpenAI-compatible HTTP server in front of the engine process, with SGLang's native API beside it
(/generate and the RL control endpoints, entrypoints/native/).

    python -m fastdeploy_r3.entrypoints.openai.api_server --model DIR \\
        --routing-replay-config '{"enable_routing_replay": true}' --port 8000 [--api-key K]

Start-up order: parse and validate the config (a bad flag exits with a message before anything
starts), reach the routing store, bind the port, start the engine process, then serve. The engine
process is shut down when the server stops (SIGINT/SIGTERM included). When the engine dies or stalls,
the server answers what is in flight with the error, logs why, and exits with code 1, so that its
supervisor (systemd, Kubernetes) restarts the whole tree instead of a server that answers 503 forever.

Exposure (issue 11): request bodies over --max-request-body-mb are refused (413) before they are
read; a client that hangs up has its request aborted (entrypoints/openai/disconnect.py); /docs and
/openapi.json exist only with --enable-docs; with --api-key, /metrics needs the key too unless
--metrics-without-api-key; a 500 names what failed and an id to find the details in the log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastdeploy_r3.config import ConfigError, EngineConfig, add_engine_args, engine_config_from_args
from fastdeploy_r3.config.hub import resolve_model_path
from fastdeploy_r3.engine.messages import EngineStateQuery
from fastdeploy_r3.entrypoints.engine_client import AsyncEngineClient, EngineStartupError
from fastdeploy_r3.entrypoints.native.api import add_native_routes
from fastdeploy_r3.entrypoints.native.server_info import ServerAddress, add_info_routes, redacted, scrub_paths
from fastdeploy_r3.entrypoints.openai.api_key import ApiKeyCheck
from fastdeploy_r3.entrypoints.openai.connection_limits import (
    AnsweringServer,
    accept_backlog,
    bounded_h11,
    default_max_connections,
)
from fastdeploy_r3.entrypoints.openai.disconnect import unless_gone
from fastdeploy_r3.entrypoints.openai.metrics import render_metrics
from fastdeploy_r3.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from fastdeploy_r3.entrypoints.openai.request_limits import BodySizeLimit, RequestBounds, longest_token_chars
from fastdeploy_r3.entrypoints.openai.serving_chat import OpenAIServingChat
from fastdeploy_r3.entrypoints.openai.serving_completion import OpenAIServingCompletion
from fastdeploy_r3.entrypoints.openai.serving_engine import (
    DEFAULT_REQUEST_TIMEOUT_S,
    OpenAIError,
    ServingContext,
    engine_unavailable,
)
from fastdeploy_r3.entrypoints.pd.roles import (
    PdDecode,
    PdPrefill,
    add_pd_args,
    check_pd_flags,
    pd_engine_fields,
    start_pd_role,
)
from fastdeploy_r3.lifecycle import EngineDeadError, freeze_startup_heap
from fastdeploy_r3.r3.rollout_id import MAX_CHOICES, validate_namespace
from fastdeploy_r3.r3.stores import RedisRoutingStore, RoutingStore, RoutingStoreError, make_routing_store

logger = logging.getLogger("fastdeploy_r3.api_server")

_HEALTH_TIMEOUT_S = 10.0


def make_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description="fastdeploy_r3 OpenAI-compatible server")
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("FDR3_API_KEY"), help="require 'Authorization: Bearer "
                        "KEY' on /v1/* and /metrics (default: $FDR3_API_KEY, else no key)")
    parser.add_argument("--metrics-without-api-key", action="store_true",
                        help="serve /metrics without the API key (for a scraper that cannot send one)")
    parser.add_argument("--health-without-api-key", action="store_true",
                        help="serve /health without the API key (for a liveness probe that cannot send one)")
    parser.add_argument("--enable-docs", action="store_true", help="serve /docs and /openapi.json (off by default)")
    parser.add_argument("--max-request-body-mb", type=float, default=16.0,
                        help="larger request bodies are refused with 413 before they are read (default: %(default)s)")
    parser.add_argument("--request-timeout-s", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                        help="a request not answered this many seconds after it arrived is aborted (504); a "
                        "request's own `timeout` field overrides it (default: %(default)s)")
    parser.add_argument("--max-n", type=int, default=RequestBounds.max_n,
                        help="the most choices (n) one prompt may ask for (default: %(default)s; the OpenAI "
                        f"endpoints stop at {MAX_CHOICES} whatever this says, one R3 key per choice)")
    parser.add_argument("--max-batch-size", type=int, default=RequestBounds.max_batch_size,
                        help="the most prompts x n of one /generate call (default: %(default)s)")
    parser.add_argument("--enable-memory-saver", action="store_true",
                        help="say so in /server_info (SGLang's flag: slime and miles compare it with their offload "
                        "setting); /release_memory_occupation and /resume_memory_occupation work either way")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="every /generate answer carries routed_experts unless the request sends "
                        "return_routed_experts: false (SGLang's flag; a router that drops unknown fields, as "
                        "sglang-router does, drops the per-request field); needs routing replay on")
    parser.add_argument("--shutdown-grace-s", type=float, default=5.0,
                        help="on SIGTERM, requests in flight get this long to finish; those still held after it "
                        "(paused, or long) are answered 503 with the reason (default: %(default)s)")
    parser.add_argument("--header-timeout-s", type=float, default=15.0,
                        help="a connection that has not sent a whole request header this long after it opened (or "
                        "after its last response) is closed (default: %(default)s)")
    parser.add_argument("--keep-alive-timeout-s", type=float, default=5.0,
                        help="an idle keep-alive connection is closed after this long (default: %(default)s)")
    parser.add_argument("--max-connections", type=int, default=None,
                        help="open client connections past this are closed at once (default: three quarters of the "
                        "fd limit, less 64)")
    parser.add_argument("--served-model-name", default=None, help="model name clients send (default: --model)")
    parser.add_argument("--r3-namespace", default="fdr3", help="this deployment's part of the R3 p2pstore, "
                        "[A-Za-z0-9._-]: keys are {namespace}/{rollout_id}[/layer_{layer}]")
    parser.add_argument("--engine-start-timeout", type=float, default=900.0)
    parser.add_argument("--engine-stall-timeout-s", type=float, default=None, help="an engine silent this long "
                        "(stopped, stuck) is killed and the server exits (default: --worker-step-timeout-s + 30)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_pd_args(parser)
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
        "routing_layout": rr.routing_layout,
        "num_hidden_layers": rr.num_hidden_layers,
        "debug_mode": rr.debug_mode,
        "namespace": namespace if isinstance(store, RedisRoutingStore) or getattr(store, "key_style", "") == "fdr3"
        else None,
        "p2pstore_url": rr.p2pstore_url,
        "local_store_dir": rr.local_store_dir,  # dropped by redacted(): a server path is no client's business
        "block_size": cfg.cache_config.block_size,
    }
    return ModelCard(id=ctx.served_model_name, root=cfg.model_config.model, max_model_len=ctx.engine.info.max_model_len,
                     r3=redacted(r3))


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


def build_app(
    ctx: ServingContext,
    api_key: str | None,
    namespace: str,
    *,
    max_request_body_bytes: int = 16 * 2**20,
    enable_docs: bool = False,
    metrics_without_api_key: bool = False,
    health_without_api_key: bool = False,
    address: ServerAddress = ServerAddress("127.0.0.1", 0),
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn re-raises SIGTERM/SIGINT after serving; shut the engine down before that
        await ctx.engine.shutdown()

    docs = {} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="fastdeploy_r3", lifespan=lifespan, **docs)
    completion = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)
    # with a key, every endpoint needs it (the native API changes weights; /health says what is degraded),
    # except those a probe or scraper that cannot send one is let into
    open_paths = (("/metrics",) if metrics_without_api_key else ()) + (("/health",) if health_without_api_key else ())
    # added first, so it sits innermost (next to the routes): its 413 raised from receive() reaches
    # FastAPI as an HTTPException
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=api_key, open_paths=open_paths)

    @app.exception_handler(OpenAIError)
    async def on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

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
        # the exception's text may hold paths or internals: it goes to the log under an error id only
        error_id = f"err-{uuid.uuid4().hex[:16]}"
        logger.exception("unhandled error %s on %s", error_id, request.url.path)
        err = OpenAIError(500, f"internal error while serving {request.url.path} (error id {error_id}); the "
                          "server log has the details", "internal_server_error")
        return JSONResponse(err.body(), status_code=500)

    async def health_body() -> tuple[dict[str, str | None], bool]:
        """({"status", "engine", "paused", and per degraded part why}, can it serve: R3 store up, weights whole).

        Never waits on a store: its state is the last probe's (r3/delivery.py probes in the background),
        so a stalled store cannot make a health check time out. Paths are scrubbed from the reasons."""
        degraded = await ctx.engine.check_health(_HEALTH_TIMEOUT_S)
        r3_problem = ctx.delivery.store_problem()
        if r3_problem is not None:
            degraded["r3_store"] = r3_problem
        paused = (await ctx.engine.control(EngineStateQuery(), timeout_s=_HEALTH_TIMEOUT_S)).state.paused
        status = "degraded" if degraded else ("paused" if paused is not None else "ok")
        body: dict[str, str | None] = {"status": status, "engine": "ok", "paused": paused}
        body.update({part: scrub_paths(why) for part, why in degraded.items()})
        return body, r3_problem is None and "weights" not in degraded

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
        """Readiness: 200 only while the server can serve requests and deliver their R3 (not: mixed weights)."""
        try:
            body, can_serve = await health_body()
        except EngineDeadError as e:
            return JSONResponse(engine_unavailable(str(e)).body(), status_code=503)
        return JSONResponse(body, status_code=200 if can_serve else 503)

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
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        return await unless_gone(raw, completion.create_completion(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        return await unless_gone(raw, chat.create_chat_completion(request))

    add_native_routes(app, ctx)
    add_info_routes(app, ctx, address)

    return app


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named explicitly: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto is TCP, and
    # with Nagle on every response waited ~40 ms for the client's delayed ACK (each control call, each chunk)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class EngineLostError(RuntimeError):
    """The engine died or stalled while serving; the server exits non-zero so a supervisor restarts it."""


def check_serving_flags(args: argparse.Namespace, config: EngineConfig) -> None:
    """The request-bound flags, refused with a message before anything starts."""
    for name in ("max_n", "max_batch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}; use a positive integer")
    if args.enable_return_routed_experts and not config.routing_replay_config.enable_routing_replay:
        raise ConfigError("--enable-return-routed-experts needs routing replay: add --routing-replay-config "
                          "'{\"enable_routing_replay\": true}'")
    check_pd_flags(args, config)


async def run_server(args: argparse.Namespace) -> None:
    served_model_name = args.served_model_name or args.model  # a Hub id stays the name clients send
    args.model = resolve_model_path(args.model)  # a Hub id: its snapshot in the Hugging Face cache
    config = engine_config_from_args(args, **pd_engine_fields(args))  # ConfigError: bad flags, before anything starts
    check_serving_flags(args, config)
    namespace = validate_namespace(args.r3_namespace, "--r3-namespace")
    store = make_routing_store(config.routing_replay_config, namespace)
    if isinstance(store, RedisRoutingStore):
        store.ping()  # a MooncakeRoutingStore joined its master when it was made
    from fastdeploy_r3.engine.tokenizer import check_tokenizer_dir, load_tokenizer

    tokenizer_dir = check_tokenizer_dir(config.model_config.tokenizer or config.model_config.model)
    sock = _bind(args.host, args.port)  # fail on a taken port before the (slow) engine start
    # until uvicorn installs its handlers, SIGTERM must unwind through the finally below
    signal.signal(signal.SIGTERM, _raise_system_exit)
    engine: AsyncEngineClient | None = None
    pd: PdPrefill | PdDecode | None = None
    lost: list[str] = []
    try:
        # the engine starts while transformers loads the tokenizer (seconds: transformers imports torch)
        starting = asyncio.create_task(AsyncEngineClient.start(
            config, None, timeout_s=args.engine_start_timeout, stall_timeout_s=args.engine_stall_timeout_s))
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_dir)
        except BaseException:
            starting.cancel()  # AsyncEngineClient.start stops what it started
            await asyncio.gather(starting, return_exceptions=True)
            raise
        (engine := await starting).tokenizer = tokenizer
        pd = await start_pd_role(args, engine)
        ctx = ServingContext(pd=pd, engine=engine, served_model_name=served_model_name, store=store,
                             request_timeout_s=args.request_timeout_s,
                             longest_token_chars=longest_token_chars(tokenizer),
                             bounds=RequestBounds(args.max_n, args.max_batch_size),
                             enable_return_routed_experts=args.enable_return_routed_experts,
                             enable_memory_saver=args.enable_memory_saver)
        app = build_app(ctx, args.api_key, namespace, max_request_body_bytes=int(args.max_request_body_mb * 2**20),
                        enable_docs=args.enable_docs, metrics_without_api_key=args.metrics_without_api_key,
                        health_without_api_key=args.health_without_api_key,
                        address=ServerAddress(args.host, sock.getsockname()[1]))
        max_connections = args.max_connections or default_max_connections()
        server = AnsweringServer(uvicorn.Config(
            app, log_level=args.log_level, timeout_keep_alive=args.keep_alive_timeout_s, backlog=accept_backlog(),
            http=bounded_h11(args.header_timeout_s, max_connections)), engine, args.shutdown_grace_s)

        def on_engine_dead(message: str) -> None:
            # in-flight requests already got the error; uvicorn lets their responses finish, then exits
            logger.error("the engine is gone (%s); the server exits with code 1 so that its supervisor restarts it",
                         message)
            lost.append(message)
            server.should_exit = True

        engine.on_dead = on_engine_dead
        logger.info("serving %s on http://%s:%d", ctx.served_model_name, args.host, args.port)
        freeze_startup_heap()
        await server.serve(sockets=[sock])
        if lost:
            raise EngineLostError(f"the engine is gone ({lost[0]}); exiting with code 1 so that a supervisor "
                                  "restarts the server")
    finally:
        if pd is not None:
            await pd.close()
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
