"""HTTP errors of the OpenAI-compatible and native servers: an OpenAI-style body with a status.

500s say what failed and the request id; exception text and paths go to the log only.
"""

from __future__ import annotations

import logging

from fastdeploy_r3.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("fastdeploy_r3.api_server")


class OpenAIError(Exception):
    """An error answered as an OpenAI-style body with an HTTP status."""

    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.headers = headers

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status)
        return ErrorResponse(error=info).model_dump()


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)


def engine_error(message: str) -> OpenAIError:
    return OpenAIError(500, message, "internal_server_error")


def engine_unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, "service_unavailable")


def internal_error(what: str, request_id: str, detail: object) -> OpenAIError:
    """A 500 that says what failed and for which request; the detail (exception text, paths) is logged."""
    logger.error("request %s: %s: %s", request_id, what, detail)
    return OpenAIError(500, f"{what} (request {request_id}); the server log has the details", "internal_server_error")


def conflict(message: str, param: str) -> OpenAIError:
    return OpenAIError(409, message, "conflict_error", param)
