"""The API key check (--api-key), as plain ASGI middleware.

Starlette's `@app.middleware("http")` (BaseHTTPMiddleware) would relay every body chunk of every
response through a memory stream of its own: on a streamed answer that was a quarter of the API
server's CPU per token at 256 concurrent streams (tools/bench_rollout.py's host CPU line). This
class looks at the headers once and then hands the app the ASGI callables untouched.
"""

from __future__ import annotations

import secrets

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from fastdeploy_r3.entrypoints.openai.errors import OpenAIError


class ApiKeyCheck:
    """Every HTTP request must carry `Authorization: Bearer <api_key>`, except on `open_paths`."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            auth = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            if not secrets.compare_digest(auth, self.expected):
                err = OpenAIError(401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                                  "authentication_error")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
