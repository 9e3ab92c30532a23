"""`GET /openapi.json`: the API's OpenAPI 3.1 document, generated from the app's routes and the pydantic schemas.

A route's request body is the model its handler parses, declared with `@request_body(Model)` on the handler; every
route of the app is listed (a new route appears by itself, with its body once it is declared). Errors are
documented once per shape, for every status a route may answer: OpenAI's (`ErrorResponse`), Anthropic's
(`AnthropicErrorResponse`) on its routes. Fuzzers (schemathesis in tests/gateway) generate requests from this
document.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.routing import BaseRoute, Route

from .errors import anthropic_route

_REF = "#/components/schemas/{model}"
F = TypeVar("F", bound=Callable[..., Any])


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx / 5xx body (errors.py) but on Anthropic's routes."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """A 4xx / 5xx body on Anthropic's routes (/v1/messages*)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


def request_body(model: type[BaseModel]) -> Callable[[F], F]:
    """Declare the JSON body a handler parses (only read here: the handler still calls `parse`)."""
    def mark(fn: F) -> F:
        fn.request_model = model  # type: ignore[attr-defined]
        return fn
    return mark


def build(routes: list[BaseRoute], title: str, version: str) -> dict[str, Any]:
    """The document for these routes (Starlette `Route`s whose endpoints may carry `request_model`)."""
    plain = [r for r in routes if isinstance(r, Route)]
    models = {m for r in plain if (m := getattr(r.endpoint, "request_model", None)) is not None}
    refs, top = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)]
                                   + [(ErrorResponse, "serialization"), (AnthropicErrorResponse, "serialization")],
                                   ref_template=_REF)
    errors = {shape: {"description": f"{shape}-shaped error",
                      "content": {"application/json": {"schema": refs[(model, "serialization")]}}}
              for shape, model in (("OpenAI", ErrorResponse), ("Anthropic", AnthropicErrorResponse))}
    paths: dict[str, Any] = {}
    for r in plain:
        model = getattr(r.endpoint, "request_model", None)
        for method in sorted((r.methods or set()) - {"HEAD"}):
            error = errors["Anthropic" if anthropic_route(r.path) else "OpenAI"]
            op: dict[str, Any] = {"operationId": f"{method.lower()}_{r.name}",
                                  "responses": {"200": {"description": "OK"}, "4XX": error, "5XX": error}}
            if model is not None:
                op["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": refs[(model, "validation")]}}}
            paths.setdefault(r.path, {})[method.lower()] = op
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": top.get("$defs", {})}}
