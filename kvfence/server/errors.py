"""Every error the server returns, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Boundary: turns exceptions into HTTP responses and nothing else. Handlers raise `OpenAIError` (or let an engine
`AdmissionError` through); `install_handlers` makes sure that no other shape, FastAPI's 422 included, ever
reaches a client.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfence.engine.admission import Limits
from kvfence.engine.errors import AdmissionError, ContextLengthExceeded, PoolCapacityExceeded

log = logging.getLogger("kvfence.server")

INTEGRITY_MESSAGE = (
    "The request failed a KV-cache integrity check and was stopped; no output was returned. "
    "This is a server-side fault, not a problem with the request."
)


class OpenAIError(Exception):
    """An error response. `status` is the HTTP status; the rest is the body's `error` object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def sse(self) -> str:
        """The streaming form: one server-sent event carrying the error object (then the stream closes)."""
        return f"data: {json.dumps(self.body())}\n\n"

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(param: str | None, message: str, code: str | None = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def from_admission(
    exc: AdmissionError, input_param: str | None = None, limits: Limits | None = None
) -> OpenAIError:
    """I5 rejections keep the engine's code. `input_param` (`prompt` or `messages`) replaces the engine's
    guess at which field holds the prompt; with `limits`, a length rejection names both the context length
    and the KV pool's tokens when the pool is the smaller (`--allow-undersized-pool`)."""
    param = input_param if input_param is not None and exc.param in ("prompt", "messages") else exc.param
    return OpenAIError(400, _both_limits(exc, limits), param=param, code=exc.code)


def _both_limits(exc: AdmissionError, limits: Limits | None) -> str:
    if limits is None:
        return str(exc)
    pool_tokens = limits.pool_pages * limits.page_size
    if isinstance(exc, ContextLengthExceeded):
        return str(
            ContextLengthExceeded(exc.num_prompt_tokens, exc.max_tokens, exc.context_length, pool_tokens)
        )
    if isinstance(exc, PoolCapacityExceeded) and pool_tokens < limits.context_length:
        return str(
            PoolCapacityExceeded(
                exc.num_tokens, exc.num_pages, exc.pool_pages, exc.page_size, limits.context_length
            )
        )
    return str(exc)


def integrity_error() -> OpenAIError:
    return OpenAIError(500, INTEGRITY_MESSAGE, type="server_error", code="kv_integrity_error")


CLIENT_ERROR_CODES = {"context_length_exceeded", "invalid_prompt", "invalid_value", "invalid_request_error"}
UNAVAILABLE_CODES = {"worker_unavailable", "decode_unavailable"}


def engine_failed(code: str | None) -> OpenAIError:
    if code == "kv_integrity_error":
        return integrity_error()
    if code in CLIENT_ERROR_CODES:  # PD: a worker's own admission refused what the router let through
        return OpenAIError(400, f"the request was refused by a worker ({code})", code=code)
    if code in UNAVAILABLE_CODES:  # PD: the worker serving it died or has no room; retrying may succeed
        return OpenAIError(
            503, f"the request lost its worker ({code})", type="server_error", code=code,
            headers={"Retry-After": "1"},
        )  # fmt: skip
    return OpenAIError(500, f"the request failed in the engine ({code})", type="server_error", code=code)


def overloaded(retry_after_s: int, message: str) -> OpenAIError:
    return OpenAIError(
        503,
        message,
        type="server_overloaded",
        code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, type="server_error", code="engine_unavailable")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(AdmissionError)
    async def _admission(_: Request, exc: AdmissionError) -> JSONResponse:
        return from_admission(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        param = ".".join(str(p) for p in errors[0]["loc"][1:]) if errors else None
        return invalid(param or None, errors[0]["msg"] if errors else "invalid request").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return OpenAIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return OpenAIError(
            500, "internal server error", type="server_error", code="internal_error"
        ).response()
