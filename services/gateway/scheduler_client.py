"""grpc.aio client for the scheduler's `Generator` service, and the mapping of its statuses to HTTP errors."""

from __future__ import annotations

import re

import grpc

from services.common.internal_auth import aio_channel
from twinspark.v1 import generate_pb2, generate_pb2_grpc

from .errors import GatewayError, context_length_exceeded, internal, unavailable

# A prompt of a million int32 ids is 4 MB, gRPC's default message limit; allow far more.
_MAX_MESSAGE = 256 * 1024 * 1024
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
    # gRPC backs off up to 2 minutes between reconnects by default, failing calls fast meanwhile; a gateway started
    # before its scheduler (or across a scheduler restart) would then answer 503 long after the scheduler is back.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class SchedulerClient:
    def __init__(self, target: str, token: str | None = None) -> None:
        self.target = target
        self._token = token
        self._channel: grpc.aio.Channel | None = None
        self._stub: generate_pb2_grpc.GeneratorStub | None = None

    async def start(self) -> None:
        # The channel binds to the running event loop, so it is made here (in the server's lifespan), not in __init__.
        self._channel = aio_channel(self.target, self._token, _CHANNEL_OPTIONS)
        self._stub = generate_pb2_grpc.GeneratorStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel = None

    @property
    def stub(self) -> generate_pb2_grpc.GeneratorStub:
        if self._stub is None:
            raise RuntimeError("SchedulerClient.start() was not awaited")
        return self._stub

    def generate(self, request: generate_pb2.GenerateRequest,
                 metadata: tuple[tuple[str, str], ...] = ()) -> grpc.aio.UnaryStreamCall:
        """Start a Generate stream; events are read from the returned call (cancel it to abort)."""
        return self.stub.Generate(request, metadata=metadata or None)

    async def abort(self, request_id: str, timeout_s: float = 1.0) -> bool:
        reply = await self.stub.Abort(generate_pb2.AbortRequest(request_id=request_id), timeout=timeout_s)
        return reply.found

    async def health(self, timeout_s: float = 2.0) -> generate_pb2.HealthReply:
        return await self.stub.Health(generate_pb2.HealthRequest(), timeout=timeout_s)


def retry_after(err: grpc.aio.AioRpcError) -> str:
    """Whole seconds from the scheduler's `retry-after` trailing metadata (1 when it sent none or garbage)."""
    for key, value in (err.trailing_metadata() or ()):
        if key.lower() == "retry-after":
            text = value.decode() if isinstance(value, bytes) else str(value)
            try:
                return str(max(0, int(float(text.strip()) + 0.999)))
            except ValueError:
                break
    return "1"


_CODE_PREFIX = re.compile(r"^\s*([a-z][a-z0-9_]*)\s*:\s*(.*)$", re.S)


def map_rpc_error(err: grpc.aio.AioRpcError, prompt_param: str) -> GatewayError:
    """A Generate status as the HTTP error the contract promises (see generate.proto)."""
    code = err.code()
    details = err.details() or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return GatewayError(429, f"the server is at capacity, retry later ({details})".replace(" ()", ""),
                            code="rate_limit_exceeded", headers={"Retry-After": retry_after(err)})
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        m = _CODE_PREFIX.match(details)
        if m and m.group(1) == "context_length_exceeded":
            return context_length_exceeded(details, prompt_param)
        return GatewayError(400, details or "invalid request", code=m.group(1) if m else None)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        if not details or "failed to connect" in details:  # grpc's own text names internal addresses
            return unavailable("the model is unavailable: the scheduler is unreachable")
        return unavailable(f"the model is unavailable: {details}")
    if code == grpc.StatusCode.UNAUTHENTICATED:  # a deployment mistake: the roles were given different tokens
        return unavailable("the model is unavailable: the scheduler refused the gateway's internal token")
    if code == grpc.StatusCode.CANCELLED:
        return unavailable(f"the scheduler cancelled the request: {details}")
    return internal(f"scheduler error {code.name}: {details}")
