"""Errors in each API's own shape: OpenAI's `{"error": {"message", "type", "param", "code"}}` everywhere but
Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), whose clients expect
`{"type": "error", "error": {"type", "message"}}`.

Every failure leaves the gateway through `GatewayError`, so clients (the official `openai` and `anthropic`
libraries included) always see their API's shape and the right status, whatever went wrong underneath.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.responses import JSONResponse

log = logging.getLogger("twinspark.gateway")

ANTHROPIC_ROUTE = "/v1/messages"
# Anthropic's error types by status (its API reference); other 4xx are request errors, other 5xx its api_error.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


def anthropic_route(path: str) -> bool:
    return path == ANTHROPIC_ROUTE or path.startswith(ANTHROPIC_ROUTE + "/")


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

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def body_for(self, path: str) -> dict[str, Any]:
        """The body in the shape of the API that `path` (the request's route) belongs to."""
        return self.anthropic_body() if anthropic_route(path) else self.body()

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body_for(path), status_code=self.status, headers=self.headers)


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
