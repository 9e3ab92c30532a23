"""The internal token: every gRPC call between twinspark's own services carries it, every server requires it.

The roles share one secret (`--internal-token`, env TWINSPARK_INTERNAL_TOKEN; `twinspark up` makes a new one per
run, start.sh per start, compose reads INTERNAL_TOKEN from the env file). Clients send it as gRPC metadata
`authorization: Bearer <token>` through a channel interceptor; servers check it in a server interceptor before any
handler runs (the request is not even deserialized) and answer UNAUTHENTICATED otherwise, logging who called
what. Comparison is of sha256 digests with `hmac.compare_digest`. The token itself never reaches a log line, a
span or an argv that `twinspark up` writes down.

Without a token a server accepts every caller; the CLIs then refuse to listen beyond loopback (`check_bind`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

log = logging.getLogger("twinspark.auth")

METADATA_KEY = "authorization"
ENV = "TWINSPARK_INTERNAL_TOKEN"
LOG_EVERY_S = 10.0  # refusals are logged at once, then at most once per this many seconds with a count


def _digest(value: str | bytes) -> bytes:
    return hashlib.sha256(value if isinstance(value, bytes) else value.encode("utf-8")).digest()


def group_digest(token: str | None) -> str:
    """What ranks compare at start to refuse a peer started with another token: a digest under its own label,
    never the token (nor the digest the servers compare)."""
    return hashlib.sha256(b"twinspark rank group\0" + (token or "").encode("utf-8")).hexdigest()


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata that authenticates a call (empty without a token)."""
    return ((METADATA_KEY, f"Bearer {token}"),) if token else ()


def check_bind(host: str, token: str | None, flag: str = "--host") -> None:
    """Refuse (ValueError) to serve an internal port beyond loopback without a token."""
    if token:
        return
    name = host.strip("[]")
    try:
        loopback = ipaddress.ip_address(name).is_loopback
    except ValueError:
        loopback = name == "localhost"
    if not loopback:
        raise ValueError(f"{flag} {host} is reachable from other machines: set --internal-token (env {ENV}) so that "
                         "only twinspark's own services can call it")


class _RefusalLog:
    """Log refused calls without letting a flood of them fill the disk."""

    def __init__(self, service: str) -> None:
        self.service = service
        self._next = 0.0
        self._quiet = 0

    def __call__(self, method: str, peer: str, why: str) -> None:
        now = time.monotonic()
        if now < self._next:
            self._quiet += 1
            return
        more = f" ({self._quiet} more refused since the last line)" if self._quiet else ""
        log.warning("%s refused %s from %s: %s (UNAUTHENTICATED)%s", self.service, method, peer, why, more)
        self._quiet = 0
        self._next = now + LOG_EVERY_S


class _Check:
    def __init__(self, token: str, service: str) -> None:
        self._expected = _digest(f"Bearer {token}")
        self.log = _RefusalLog(service)

    def why_not(self, details: grpc.HandlerCallDetails) -> str | None:
        """None when the call carries the token, else what is wrong (for the log; the caller learns nothing)."""
        given = [v for k, v in (details.invocation_metadata or ()) if k == METADATA_KEY]
        if not given:
            return "no internal token"
        if not hmac.compare_digest(_digest(given[0]), self._expected):
            return "wrong internal token"
        return None


_REFUSAL = "this twinspark service requires the internal token (--internal-token / " + ENV + ")"


class ServerAuth(grpc.ServerInterceptor):
    """For `grpc.server` (rank worker, drafter)."""

    def __init__(self, token: str, service: str) -> None:
        self._check = _Check(token, service)

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        why = self._check.why_not(details)
        if why is None:
            return continuation(details)

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            self._check.log(details.method, context.peer(), why)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

        return _refusing_handler(continuation(details), refuse)


class AioServerAuth(grpc.aio.ServerInterceptor):
    """For `grpc.aio.server` (scheduler)."""

    def __init__(self, token: str, service: str) -> None:
        self._check = _Check(token, service)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        why = self._check.why_not(details)
        if why is None:
            return await continuation(details)

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            self._check.log(details.method, context.peer(), why)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

        return _refusing_handler(await continuation(details), refuse)


def _refusing_handler(handler: grpc.RpcMethodHandler | None, refuse: Callable) -> grpc.RpcMethodHandler | None:
    """A handler of the same kind as the method's that only refuses; requests are left as bytes (no parsing)."""
    if handler is None:  # an unknown method: gRPC answers UNIMPLEMENTED as usual
        return None
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


def server_interceptors(token: str | None, service: str, aio: bool = False) -> Sequence[Any]:
    """The interceptors a server of `service` installs: none without a token."""
    if not token:
        return ()
    return (AioServerAuth(token, service),) if aio else (ServerAuth(token, service),)


class _AddToken:
    """Adds the token to every call of a grpc.aio channel. grpc.aio files an interceptor under the first call kind
    it implements, so each kind gets its own subclass below."""

    def __init__(self, token: str) -> None:
        self._pair = metadata(token)[0]

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        md = grpc.aio.Metadata(*(d.metadata or ()), self._pair)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, md, d.credentials, d.wait_for_ready)


class _UnaryUnary(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_AddToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_AddToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def aio_channel(target: str, token: str | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A grpc.aio channel to another twinspark service, carrying the token on every call."""
    interceptors = [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)] if token else None
    return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)
