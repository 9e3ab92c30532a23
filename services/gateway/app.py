"""The HTTP surface: routes, auth, and the glue from a validated request to a reply.

Routes: POST /v1/chat/completions, POST /v1/completions (and vLLM's /render of each), POST /v1/responses (+ GET /v1/responses/{id}), Anthropic's
POST /v1/messages and /v1/messages/count_tokens, GET /v1/models, POST /tokenize, POST /detokenize, GET /health,
GET /metrics, GET /openapi.json. Every error leaves in its API's shape (`errors.py`: OpenAI's, Anthropic's on
Anthropic's routes); no exception escapes a handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from opentelemetry import trace
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive

from services.common import telemetry
from twinspark.v1 import generate_pb2

from . import anthropic_messages as anthropic
from . import openai_responses as responses_api
from . import openapi
from .api_keys import ApiKeyMiddleware, parse_keys
from .checkpoint import CheckpointInfo
from .images import ImageLimits, ImageProcessor
from .choices import Choices
from .errors import GatewayError, bad_request, internal, log_refused
from .generation import Final
from .limits import InputLimits, InputLimitsMiddleware
from .metrics import GatewayMetrics
from .openapi import request_body
from .prepare import ModelContext, Prepared, prepare_chat, prepare_completion, prepare_translated, render_chat
from .render import render_body
from .request_fields import IgnoredFieldsHeader, UnknownFields, report
from .responses import ChunkWriter, full_response
from .scheduler_client import SchedulerClient
from .schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse_data,
                      parse_json)
from .streaming import SSEResponse, sse_events
from .template import ChatTemplate
from .thinking import ThinkingSettings
from .tokenizer import TextTokenizer

log = logging.getLogger("twinspark.gateway")

# Reachable without the API key: probes and scrapers carry no credentials (vLLM guards /v1/* the same way), and the
# API's description is public.
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})


@dataclass
class GatewaySettings:
    model_dir: str
    scheduler: str = "127.0.0.1:50051"
    served_model_name: str | None = None
    api_key: str | None = None  # comma-separated keys and `sha256:<hex>` digests (api_keys.py)
    keepalive_s: float = 1.0
    max_model_len: int | None = None
    generation_config: str = "auto"  # "auto": checkpoint sampling defaults; "vllm": OpenAI defaults only
    health_timeout_s: float = 2.0
    limits: InputLimits = field(default_factory=InputLimits)
    internal_token: str | None = None  # sent with every call to the scheduler (services/common/internal_auth.py)
    images: ImageLimits = field(default_factory=ImageLimits)  # image_url parts: remote URLs, size and time caps
    thinking: ThinkingSettings = field(default_factory=ThinkingSettings)  # budgets, effort table, forced message
    strict_request_fields: bool = False  # unknown fields: OpenAI's 400 instead of ignored (request_fields.py)


Handler = Callable[[Request], Awaitable[Response]]


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        model_dir = Path(settings.model_dir)
        checkpoint = CheckpointInfo.load(model_dir, settings.max_model_len)
        self.ctx = ModelContext(checkpoint=checkpoint, tokenizer=TextTokenizer(model_dir),
                                template=ChatTemplate.load(model_dir, checkpoint.tokenizer_config),
                                use_generation_config=settings.generation_config == "auto",
                                images=ImageProcessor.from_checkpoint(model_dir), image_limits=settings.images,
                                thinking_settings=settings.thinking)
        self.model_name = settings.served_model_name or model_dir.resolve().name
        # The served name, and the checkpoint as vLLM would name it without --served-model-name (its path).
        self.accepted_names = {self.model_name, model_dir.resolve().name, str(settings.model_dir),
                               str(model_dir.resolve())}
        self.client = SchedulerClient(settings.scheduler, settings.internal_token)
        self.metrics = GatewayMetrics(self.model_name)
        self.created = int(time.time())
        self.store = responses_api.ResponseStore()  # `store: true` responses, for previous_response_id
        self.unknown_fields = UnknownFields(strict=settings.strict_request_fields)

    # ------------------------------------------------------------------------------------------- lifecycle
    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.client.start()
        self.ctx.grammar_check.start()
        probe = asyncio.create_task(self._probe())
        log.info("gateway serving %r from %s, scheduler at %s, window %d", self.model_name, self.settings.model_dir,
                 self.settings.scheduler, self.ctx.max_model_len)
        try:
            yield
        finally:
            probe.cancel()
            self.ctx.grammar_check.close()
            await self.client.close()
            telemetry.flush()  # the last chance: uvicorn ends the process by its own SIGTERM, skipping atexit

    async def _probe(self) -> None:
        """Learn the scheduler's window at start when it is already up (best effort; /health refreshes it)."""
        with contextlib.suppress(Exception):
            self._adopt(await self.client.health(self.settings.health_timeout_s))

    def _adopt(self, reply: generate_pb2.HealthReply) -> None:
        # The scheduler may serve a shorter window than the checkpoint's (pool size, --max-model-len): check
        # against its figure in the gateway so the client gets the 400 without a scheduler round trip.
        configured = self.ctx.checkpoint.max_model_len
        if reply.max_model_len > 0:
            self.ctx.max_model_len = min(configured, reply.max_model_len)

    # ------------------------------------------------------------------------------------------------ glue
    async def parse(self, request: Request, model: type[Any]) -> Any:
        """The request's body validated into `model`, its unknown options dropped and reported (request_fields.py)
        unless the gateway is strict about them."""
        data, ignored = self.unknown_fields.accept(model, parse_json(await request.body()))
        report(request.scope, ignored)
        return parse_data(model, data)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.accepted_names:
            raise GatewayError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")

    def _log(self, prep: Prepared, status: int, outcome: str, stream: Choices, started: float) -> None:
        """The one log line of a generation request (and the same figures on its HTTP span when traced)."""
        final = stream.final
        prompt = final.prompt_tokens if final else len(prep.prompt_ids)
        completion = final.completion_tokens if final else stream.assembler.generated
        log.info("%s %s status=%d finish=%s prompt=%d completion=%d cached=%d latency=%.3fs%s",
                 prep.request.request_id, prep.kind, status, outcome, prompt, completion,
                 final.cached_tokens if final else 0, time.monotonic() - started, " stream" if prep.stream else "")
        if stream.error is not None:
            stream.error.logged = True
        span = trace.get_current_span()  # the HTTP server span (a non-recording one when tracing is off)
        if span.is_recording():
            span.set_attributes({"twinspark.request_id": prep.request.request_id,
                                 "gen_ai.request.model": self.model_name, "gen_ai.usage.input_tokens": prompt,
                                 "gen_ai.usage.output_tokens": completion, "twinspark.finish_reason": outcome,
                                 "twinspark.stream": prep.stream})

    def choices(self, prep: Prepared) -> Choices:
        return Choices(self.client, self.ctx, prep, self.metrics, keepalive_s=self.settings.keepalive_s,
                       metadata=telemetry.metadata())  # the scheduler's span is the HTTP span's child

    async def _generate(self, request: Request, prep: Prepared, started: float) -> Response:
        stream = self.choices(prep)
        headers = {"x-request-id": prep.response_id}
        if prep.stream:
            await self.start_stream(prep, stream, started)
            return SSEResponse(sse_events(stream, ChunkWriter(prep, self.model_name, self.ctx.tokenizer)),
                               headers=headers, on_close=self.stream_closed(prep, stream, started))
        finals = await self.complete(request, prep, stream, started)
        if isinstance(finals, Response):
            return finals
        texts = {s.index: s.assembler.text for s in stream.streams}
        body = full_response(prep, self.model_name, self.ctx.tokenizer, texts, finals, int(time.time()))
        return JSONResponse(body, headers=headers)

    async def start_stream(self, prep: Prepared, stream: Choices, started: float) -> None:
        """Before a stream's 200: wait for the scheduler's first answer, so 429 / 400 / 503 are HTTP statuses."""
        try:
            await stream.start(self.settings.keepalive_s)
        except GatewayError as err:
            self._log(prep, err.status, stream.close(), stream, started)
            raise
        except BaseException:
            stream.close()
            raise

    def stream_closed(self, prep: Prepared, stream: Choices, started: float) -> Callable[[bool], None]:
        def on_close(disconnected: bool) -> None:
            outcome = stream.close()
            self._log(prep, 200, "client_gone" if disconnected and stream.final is None else outcome,
                      stream, started)
        return on_close

    async def complete(self, request: Request, prep: Prepared, stream: Choices, started: float
                       ) -> list[Final] | Response:
        """Run a non-streamed generation to its end: the returned choices' finals, or the error / 499 response.
        A client that hangs up meanwhile cancels the generation."""

        async def collect() -> list[Final]:
            await stream.start(0.0)
            async for _, event in stream.events():
                pass
            if len(stream.finals) != len(stream.streams):
                raise internal("the generation ended without a result")
            return stream.best()

        work = asyncio.create_task(collect())
        gone = asyncio.create_task(_wait_disconnect(request.receive))
        try:
            try:
                await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (work, gone):
                    if not task.done():
                        task.cancel()
                await asyncio.gather(work, gone, return_exceptions=True)
            if work.cancelled():
                outcome = stream.close()
                self._log(prep, 499, "client_gone" if outcome == "abort" else outcome, stream, started)
                return Response(status_code=499)  # nobody is listening; this only ends the ASGI cycle
            exc = work.exception()
            if isinstance(exc, GatewayError):
                stream.error = exc
                self._log(prep, exc.status, stream.close(), stream, started)
                raise exc
            if exc is not None:
                raise exc
            finals = work.result()
        finally:
            stream.close()  # idempotent; also covers this handler itself being cancelled (server shutdown)
        self._log(prep, 200, finals[0].finish_reason, stream, started)
        return finals

    # ---------------------------------------------------------------------------------------------- routes
    @request_body(ChatCompletionRequest)
    async def chat_completions(self, request: Request) -> Response:
        started = time.monotonic()
        req = await self.parse(request, ChatCompletionRequest)
        self.check_model(req.model)
        return await self._generate(request, await prepare_chat(self.ctx, req), started)

    @request_body(CompletionRequest)
    async def completions(self, request: Request) -> Response:
        started = time.monotonic()
        req = await self.parse(request, CompletionRequest)
        self.check_model(req.model)
        return await self._generate(request, await prepare_completion(self.ctx, req), started)

    @request_body(ChatCompletionRequest)
    async def chat_render(self, request: Request) -> Response:
        """vLLM's `POST /v1/chat/completions/render` (render.py): the prompt's token ids, nothing generated."""
        req = await self.parse(request, ChatCompletionRequest)
        self.check_model(req.model)
        return JSONResponse(render_body(await prepare_chat(self.ctx, req), self.model_name))

    @request_body(CompletionRequest)
    async def completion_render(self, request: Request) -> Response:
        """vLLM's `POST /v1/completions/render`."""
        req = await self.parse(request, CompletionRequest)
        self.check_model(req.model)
        return JSONResponse(render_body(await prepare_completion(self.ctx, req), self.model_name))

    @request_body(responses_api.ResponsesRequest)
    async def responses(self, request: Request) -> Response:
        """OpenAI `POST /v1/responses`."""
        started = time.monotonic()
        req = await self.parse(request, responses_api.ResponsesRequest)
        self.check_model(req.model)
        history = self.store.get(req.previous_response_id)[0] if req.previous_response_id else []
        turns = history + responses_api.input_messages(req)
        prep = await prepare_translated(self.ctx, responses_api.to_chat(req, turns), responses_api.RENAMES)
        prep.response_id = f"resp_{uuid.uuid4().hex}"
        stream = self.choices(prep)
        headers = {"x-request-id": prep.response_id}

        def keep(body: dict[str, Any]) -> None:
            if req.store:
                self.store.put(body["id"], turns + responses_api.reply_messages(body["output"]), body)

        if req.stream:
            await self.start_stream(prep, stream, started)
            return SSEResponse(responses_api.response_events(req, prep, self.model_name, stream, keep),
                               headers=headers, on_close=self.stream_closed(prep, stream, started))
        finals = await self.complete(request, prep, stream, started)
        if isinstance(finals, Response):
            return finals
        body = responses_api.full_response(req, prep, self.model_name, stream, finals[0])
        keep(body)
        return JSONResponse(body, headers=headers)

    async def stored_response(self, request: Request) -> Response:
        return JSONResponse(self.store.get(request.path_params["response_id"])[1])

    @request_body(anthropic.MessagesRequest)
    async def messages(self, request: Request) -> Response:
        """Anthropic `POST /v1/messages` (its errors leave in Anthropic's shape: `_handled` shapes by route)."""
        started = time.monotonic()
        req = await self.parse(request, anthropic.MessagesRequest)
        self.check_model(req.model)
        prep = await prepare_translated(self.ctx, anthropic.to_chat(req), anthropic.RENAMES)
        prep.response_id = anthropic.new_message_id()
        stream = self.choices(prep)
        headers = {"request-id": prep.response_id}
        if req.stream:
            await self.start_stream(prep, stream, started)
            return SSEResponse(anthropic.message_events(prep, self.model_name, stream), headers=headers,
                               on_close=self.stream_closed(prep, stream, started))
        finals = await self.complete(request, prep, stream, started)
        if isinstance(finals, Response):
            return finals
        return JSONResponse(anthropic.full_message(prep, self.model_name, stream, finals[0]), headers=headers)

    @request_body(anthropic.CountTokensRequest)
    async def count_tokens(self, request: Request) -> Response:
        """Anthropic `POST /v1/messages/count_tokens`: the prompt's length as /v1/messages would render it."""
        req = await self.parse(request, anthropic.CountTokensRequest)
        self.check_model(req.model)
        chat = anthropic.to_chat(req)
        text = render_chat(self.ctx, chat.messages, True, chat.chat_template_kwargs, tools=chat.tools)
        return JSONResponse({"input_tokens": len(await self.ctx.tokenizer.encode_async(text))})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "twinspark",
            "root": str(self.settings.model_dir), "parent": None, "max_model_len": self.ctx.max_model_len,
            "permission": []}]})

    @request_body(TokenizeRequest)
    async def tokenize(self, request: Request) -> Response:
        req = await self.parse(request, TokenizeRequest)
        self.check_model(req.model)
        if req.messages is not None:
            text = render_chat(self.ctx, req.messages, req.add_generation_prompt, req.chat_template_kwargs,
                               tools=req.tools)
            add_special = bool(req.add_special_tokens)  # the template writes the special tokens itself
        else:
            text = req.prompt or ""
            add_special = req.add_special_tokens is not False
        ids = await self.ctx.tokenizer.encode_async(text, add_special_tokens=add_special)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": self.ctx.max_model_len, "tokens": ids,
                                "token_strs": None}
        if req.return_token_strs:
            body["token_strs"] = [self.ctx.tokenizer.id_to_token(t) for t in ids]
        return JSONResponse(body)

    @request_body(DetokenizeRequest)
    async def detokenize(self, request: Request) -> Response:
        req = await self.parse(request, DetokenizeRequest)
        self.check_model(req.model)
        vocab = self.ctx.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise bad_request(f"token id {t} is out of vocabulary (0..{vocab - 1})", param=f"tokens[{i}]")
        # Special tokens included, as vLLM does: /detokenize(/tokenize(x)) gives x back.
        return JSONResponse({"prompt": self.ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)})

    async def _health_reply(self) -> generate_pb2.HealthReply | None:
        try:
            reply = await self.client.health(self.settings.health_timeout_s)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            log.warning("scheduler Health failed: %s", exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else exc)
            return None
        self._adopt(reply)
        return reply

    async def health(self, request: Request) -> Response:
        reply = await self._health_reply()
        self.metrics.set_health(reply)
        if reply is None:
            return JSONResponse({"status": "unavailable", "model": self.model_name, "down": ["scheduler"],
                                 "detail": f"scheduler at {self.settings.scheduler} is unreachable"},
                                status_code=503)
        pool = reply.pool
        body = {
            # "degraded": serving goes on, but an optional component (the drafter) is down and named in "down".
            "status": ("ok" if all(c.alive for c in reply.components) else "degraded") if reply.healthy
            else "unhealthy",
            "model": reply.model or self.model_name,
            "down": [c.name for c in reply.components if not c.alive],
            "components": [{"name": c.name, "alive": c.alive, "detail": c.detail} for c in reply.components],
            "pool": {"block_size": pool.block_size, "total_blocks": pool.total_blocks,
                     "free_blocks": pool.free_blocks, "total_slots": pool.total_slots, "free_slots": pool.free_slots},
            "kv_cache_usage_perc": 1.0 - pool.free_blocks / pool.total_blocks if pool.total_blocks > 0 else 0.0,
            "running": reply.running, "waiting": reply.waiting, "max_model_len": self.ctx.max_model_len,
            "prefix_cache_queries": reply.prefix_cache_queries, "prefix_cache_hits": reply.prefix_cache_hits,
        }
        return JSONResponse(body, status_code=200 if reply.healthy else 503)

    async def metrics_endpoint(self, request: Request) -> Response:
        self.metrics.set_health(await self._health_reply())
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _version() -> str:
    try:
        return importlib.metadata.version("twinspark")
    except importlib.metadata.PackageNotFoundError:
        return "source"


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _handled(fn: Handler) -> Handler:
    """Every error becomes a response in the route's API shape (errors.py); a bug is a 500, never a dropped
    connection."""

    @functools.wraps(fn)  # keeps the handler's name and its `request_body` declaration (openapi.py)
    async def endpoint(request: Request) -> Response:
        try:
            return await fn(request)
        except GatewayError as err:
            if not err.logged:  # refused before reaching the scheduler (validation, model name, ...)
                log_refused(request.method, request.url.path, err)
            return err.response(request.url.path)
        except Exception:
            log.exception("%s %s failed", request.method, request.url.path)
            return internal().response(request.url.path)

    return endpoint


def _add_tracing(app: Starlette) -> None:
    """One SERVER span per HTTP request (outermost, so refusals are traced too), continuing a client's
    `traceparent`. The per-message send/receive sub-spans are left out: an SSE reply would get one per chunk. The
    probes are left out too: a scraper would fill the trace store with them."""
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    # Should an operator capture request headers on spans (OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_*), the keys
    # are still written as "[REDACTED]".
    app.add_middleware(OpenTelemetryMiddleware, excluded_urls=",".join(OPEN_PATHS),
                       exclude_spans=["receive", "send"],
                       http_capture_headers_sanitize_fields=["authorization", "x-api-key"])


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    err = GatewayError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", code=code)
    return err.response(request.url.path)


def create_app(settings: GatewaySettings) -> Starlette:
    gw = Gateway(settings)
    routes = [
        Route("/v1/chat/completions", _handled(gw.chat_completions), methods=["POST"]),
        Route("/v1/completions", _handled(gw.completions), methods=["POST"]),
        Route("/v1/chat/completions/render", _handled(gw.chat_render), methods=["POST"]),
        Route("/v1/completions/render", _handled(gw.completion_render), methods=["POST"]),
        Route("/v1/responses", _handled(gw.responses), methods=["POST"]),
        Route("/v1/responses/{response_id}", _handled(gw.stored_response), methods=["GET"]),
        Route("/v1/messages", _handled(gw.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", _handled(gw.count_tokens), methods=["POST"]),
        Route("/v1/models", _handled(gw.models), methods=["GET"]),
        Route("/tokenize", _handled(gw.tokenize), methods=["POST"]),
        Route("/detokenize", _handled(gw.detokenize), methods=["POST"]),
        Route("/health", _handled(gw.health), methods=["GET"]),
        Route("/metrics", _handled(gw.metrics_endpoint), methods=["GET"]),
    ]
    document: dict[str, Any] = {}  # filled below, once every route is in the list (its own route included)

    async def openapi_json(request: Request) -> Response:
        return JSONResponse(document)

    routes.append(Route("/openapi.json", openapi_json, methods=["GET"]))
    document.update(gw.unknown_fields.describe(openapi.build(routes, "twinspark", _version())))
    app = Starlette(routes=routes, lifespan=gw.lifespan, exception_handlers={HTTPException: _http_error})
    # Middleware added last runs first: tracing, then the key check (before a large body is read), then the limits,
    # then the header naming the fields a handler ignored.
    app.add_middleware(IgnoredFieldsHeader)
    app.add_middleware(InputLimitsMiddleware, limits=settings.limits)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, digests=parse_keys(settings.api_key), open_paths=OPEN_PATHS)
    if telemetry.enabled():
        _add_tracing(app)
    app.state.gateway = gw
    return app


__all__ = ["Gateway", "GatewaySettings", "create_app"]
