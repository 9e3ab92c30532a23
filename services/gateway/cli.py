"""`twinspark serve-gateway`: the OpenAI-compatible HTTP gateway in front of a scheduler.

Every flag has a TWINSPARK_* environment default, so compose files and .env set them without a command line.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from services.common import shared_flags as shared
from services.common.flags import add_subcommand, flag
from services.common.role_start import RoleSettings, start_role
from services.gateway.limits import InputLimits

_LIMITS = InputLimits()  # the input limits' defaults


def _limit(name: str, what: str) -> Any:
    """One of InputLimits' bounds as a flag (--max-body-bytes for max_body_bytes), its default InputLimits'."""
    return flag(name.replace("_", "-"), f"{what} (default %(default)s)", default=str(getattr(_LIMITS, name)),
                type=int)


@dataclass(frozen=True, kw_only=True)
class ServeGatewaySettings(RoleSettings):
    """The command line of serve-gateway (app.GatewaySettings is what the app is built from)."""

    model: str = flag(shared.MODEL, help="checkpoint directory: config, tokenizer and chat template are read from "
                      "it", required=True)
    scheduler: str = flag("scheduler", "scheduler gRPC address host:port (default %(default)s)",
                          default="127.0.0.1:50051")
    host: str = flag("host", "listen address (default %(default)s)", default="0.0.0.0")
    port: int = flag(shared.GATEWAY_PORT)
    served_model_name: str | None = flag(shared.SERVED_MODEL_NAME)
    api_key: str | None = flag(shared.API_KEY)
    max_body_bytes: int = _limit("max_body_bytes", "request body bytes (413 beyond)")
    max_json_depth: int = _limit("max_json_depth", "nesting levels of a JSON body (400 beyond)")
    max_string_chars: int = _limit("max_string_chars", "characters of one JSON string (400 beyond)")
    max_array_items: int = _limit("max_array_items", "items of one JSON array (400 beyond)")
    max_header_bytes: int = _limit("max_header_bytes", "bytes of all request headers (431 beyond)")
    # Longer than the idle expiry of HTTP client pools (httpx's, the openai client's: 5 s), so a client drops an idle
    # connection before the server closes it: at uvicorn's 5 s both ends could act at once, and a request sent on a
    # connection the server is closing fails with "Server disconnected" (a client without retries sees the error).
    timeout_keep_alive: int = flag("timeout-keep-alive", "seconds an idle HTTP keep-alive connection stays open "
                                   "(uvicorn's flag; default %(default)s)", default="30", type=int)
    keepalive_s: float = flag("keepalive-s", "SSE keepalive comment interval while nothing else is sent; also how "
                              "long a stream waits for the scheduler's first answer before sending its 200 (default "
                              "%(default)s)", default="1.0", type=float)
    max_model_len: int | None = flag("max-model-len", "cap the context window below the checkpoint's (the "
                                     "scheduler's smaller figure, from Health, applies anyway)", type=int)
    generation_config: str = flag("generation-config", "'auto': sampling fields a request omits take the "
                                  "checkpoint's generation_config.json values (vLLM's default); 'vllm': OpenAI "
                                  "defaults (temperature 1, top_p 1) (default %(default)s)", default="auto",
                                  choices=("auto", "vllm"))
    allow_image_urls: bool = flag("allow-image-urls", "fetch http(s) image_url parts (public addresses only, no "
                                  "redirects); off: only data: URLs", switch=True)
    image_max_bytes: int = flag("image-max-bytes", "largest image accepted, encoded (default %(default)s)",
                                default=str(20 << 20), type=int)
    image_fetch_timeout: float = flag("image-fetch-timeout", "seconds a remote image may take to fetch (default "
                                      "%(default)s)", default="10", type=float)
    reasoning_budget: int = flag(shared.REASONING_BUDGET)
    reasoning_budget_message: str | None = flag(shared.REASONING_BUDGET_MESSAGE)
    reasoning_effort_budgets: str = flag(shared.REASONING_EFFORT_BUDGETS)
    strict_request_fields: bool = flag(shared.STRICT_REQUEST_FIELDS)

    def input_limits(self) -> InputLimits:
        return InputLimits(max_body_bytes=self.max_body_bytes, max_json_depth=self.max_json_depth,
                           max_string_chars=self.max_string_chars, max_array_items=self.max_array_items,
                           max_header_bytes=self.max_header_bytes)


def register(sub: argparse._SubParsersAction) -> None:
    add_subcommand(sub, "serve-gateway", ServeGatewaySettings, serve_gateway,
                   help="serve the OpenAI-compatible HTTP API (gateway -> scheduler)",
                   description="Serve /v1/chat/completions, /v1/completions, /v1/models, /tokenize, /detokenize, "
                               "/health and /metrics; generation is forwarded to the scheduler over gRPC as token ids.")


def serve_gateway(s: ServeGatewaySettings) -> int:
    import uvicorn

    from .app import GatewaySettings, create_app
    from .images import ImageLimits
    from .thinking import ThinkingSettings

    # (tracing before create_app: it adds the HTTP span middleware when on)
    start_role("gateway", s, log_format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        limits = s.input_limits()
        settings = GatewaySettings(model_dir=s.model, scheduler=s.scheduler, served_model_name=s.served_model_name,
                                   api_key=s.api_key or None, keepalive_s=s.keepalive_s, max_model_len=s.max_model_len,
                                   generation_config=s.generation_config, limits=limits,
                                   internal_token=s.internal_token, strict_request_fields=s.strict_request_fields,
                                   images=ImageLimits(allow_urls=s.allow_image_urls, max_bytes=s.image_max_bytes,
                                                      timeout_s=s.image_fetch_timeout),
                                   thinking=ThinkingSettings.from_flags(s.reasoning_budget, s.reasoning_budget_message,
                                                                        s.reasoning_effort_budgets))
        app = create_app(settings)
    except (FileNotFoundError, ValueError) as exc:
        print(f"serve-gateway: {exc}", file=sys.stderr)
        return 2
    # uvicorn's access log is replaced by our one line per generation request (id, status, tokens, latency). h11's
    # own bound on a request head sits above ours, so oversized headers get our OpenAI-shaped 431.
    uvicorn.run(app, host=s.host, port=s.port, log_level=s.log_level, access_log=False,
                timeout_keep_alive=s.timeout_keep_alive,
                h11_max_incomplete_event_size=limits.max_header_bytes + (16 << 10))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m services.gateway.cli ...` (same as `twinspark serve-gateway ...`)."""
    parser = argparse.ArgumentParser(prog="twinspark")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve-gateway", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
