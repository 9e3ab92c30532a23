"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Every failure leaves the gateway through `GatewayError`, so clients (the official `openai` library included) always
see the same shape and the right status, whatever went wrong underneath.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.responses import JSONResponse

log = logging.getLogger("twinspark.gateway")


class GatewayError(Exception):
    """An error with its HTTP status and OpenAI fields; raise it anywhere in request handling."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or default_type(status)
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.logged = False  # the request's log line already reported it

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def default_type(status: int) -> str:
    """OpenAI's `type` for a status: client mistakes are `invalid_request_error`, ours are `server_error`."""
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def unsupported(param: str, why: str = "is not supported by this server") -> GatewayError:
    """A field we understand but do not implement: refused, never silently ignored."""
    return GatewayError(400, f"'{param}' {why}", param=param, code="unsupported_parameter")


def context_length_exceeded(message: str, param: str) -> GatewayError:
    return GatewayError(400, message, param=param, code="context_length_exceeded")


def unavailable(message: str) -> GatewayError:
    return GatewayError(503, message, code="service_unavailable")


def internal(message: str = "internal server error") -> GatewayError:
    return GatewayError(500, message, code="internal_error")


def log_refused(method: str, path: str, err: GatewayError) -> None:
    """The log line of a request refused before it reached the scheduler. The message goes to DEBUG only: it may
    quote what the client sent (a prompt's text must never reach the log at INFO)."""
    param = err.param if err.param is None or len(err.param) <= 120 else err.param[:120] + "…"
    log.info("%s %s status=%d code=%s param=%s", method, path, err.status, err.code, param)
    log.debug("%s %s status=%d: %s", method, path, err.status, err.message)
