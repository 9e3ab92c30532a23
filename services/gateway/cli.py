"""`twinspark serve-gateway`: the OpenAI-compatible HTTP gateway in front of a scheduler.

Every flag has a TWINSPARK_* environment default, so compose files and .env set them without a command line.
"""

from __future__ import annotations

import argparse
import logging
import sys

from services.common.env import add_internal_token_flag, env
from services.gateway.limits import InputLimits


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve-gateway", help="serve the OpenAI-compatible HTTP API (gateway -> scheduler)",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /tokenize, /detokenize, /health and "
                    "/metrics; generation is forwarded to the scheduler over gRPC as token ids.")
    model = env("MODEL")
    p.add_argument("--model", default=model, required=model is None,
                   help="checkpoint directory: config, tokenizer and chat template are read from it "
                        "(env TWINSPARK_MODEL)")
    p.add_argument("--scheduler", default=env("SCHEDULER", "127.0.0.1:50051"),
                   help="scheduler gRPC address host:port (env TWINSPARK_SCHEDULER; default %(default)s)")
    p.add_argument("--host", default=env("HOST", "0.0.0.0"), help="listen address (env TWINSPARK_HOST; "
                                                                   "default %(default)s)")
    p.add_argument("--port", type=int, default=int(env("PORT", "8888") or 8888),
                   help="listen port (env TWINSPARK_PORT; default %(default)s)")
    p.add_argument("--served-model-name", default=env("SERVED_MODEL_NAME"),
                   help="model name clients send and see (env TWINSPARK_SERVED_MODEL_NAME; default the checkpoint "
                        "directory's name)")
    p.add_argument("--api-key", default=env("API_KEY"),
                   help="require one of these keys, comma-separated (an entry 'sha256:HEX' is a key's digest), as "
                        "'Authorization: Bearer KEY' or 'x-api-key: KEY' on every route but /health, /metrics and "
                        "/openapi.json (env TWINSPARK_API_KEY)")
    limits = InputLimits()
    for name, what in (("max_body_bytes", "request body bytes (413 beyond)"),
                       ("max_json_depth", "nesting levels of a JSON body (400 beyond)"),
                       ("max_string_chars", "characters of one JSON string (400 beyond)"),
                       ("max_array_items", "items of one JSON array (400 beyond)"),
                       ("max_header_bytes", "bytes of all request headers (431 beyond)")):
        flag = name.upper()
        p.add_argument("--" + name.replace("_", "-"), type=int, default=int(env(flag, str(getattr(limits, name)))),
                       help=f"{what} (env TWINSPARK_{flag}; default %(default)s)")
    add_internal_token_flag(p)
    p.add_argument("--keepalive-s", type=float, default=float(env("KEEPALIVE_S", "1.0") or 1.0),
                   help="SSE keepalive comment interval while nothing else is sent; also how long a stream waits "
                        "for the scheduler's first answer before sending its 200 (env TWINSPARK_KEEPALIVE_S; "
                        "default %(default)s)")
    max_len = env("MAX_MODEL_LEN")
    p.add_argument("--max-model-len", type=int, default=int(max_len) if max_len else None,
                   help="cap the context window below the checkpoint's (env TWINSPARK_MAX_MODEL_LEN; the "
                        "scheduler's smaller figure, from Health, applies anyway)")
    p.add_argument("--generation-config", choices=["auto", "vllm"], default=env("GENERATION_CONFIG", "auto"),
                   help="'auto': sampling fields a request omits take the checkpoint's generation_config.json "
                        "values (vLLM's default); 'vllm': OpenAI defaults (temperature 1, top_p 1) "
                        "(env TWINSPARK_GENERATION_CONFIG; default %(default)s)")
    p.add_argument("--allow-image-urls", action="store_true", default=env("ALLOW_IMAGE_URLS", "0") == "1",
                   help="fetch http(s) image_url parts (public addresses only, no redirects); off: only data: URLs "
                        "(env TWINSPARK_ALLOW_IMAGE_URLS=1)")
    p.add_argument("--image-max-bytes", type=int, default=int(env("IMAGE_MAX_BYTES", str(20 << 20))),
                   help="largest image accepted, encoded (env TWINSPARK_IMAGE_MAX_BYTES; default %(default)s)")
    p.add_argument("--image-fetch-timeout", type=float, default=float(env("IMAGE_FETCH_TIMEOUT", "10")),
                   help="seconds a remote image may take to fetch (env TWINSPARK_IMAGE_FETCH_TIMEOUT; default "
                        "%(default)s)")
    p.add_argument("--log-level", default=env("LOG_LEVEL", "info"),
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="(env TWINSPARK_LOG_LEVEL; default %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from services.common.telemetry import setup_tracing

    from .app import GatewaySettings, create_app
    from .images import ImageLimits

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing("twinspark-gateway")  # before create_app: it adds the HTTP span middleware when on
    try:
        limits = InputLimits(max_body_bytes=args.max_body_bytes, max_json_depth=args.max_json_depth,
                             max_string_chars=args.max_string_chars, max_array_items=args.max_array_items,
                             max_header_bytes=args.max_header_bytes)
        settings = GatewaySettings(model_dir=args.model, scheduler=args.scheduler,
                                   served_model_name=args.served_model_name, api_key=args.api_key or None,
                                   keepalive_s=args.keepalive_s, max_model_len=args.max_model_len,
                                   generation_config=args.generation_config, limits=limits,
                                   internal_token=args.internal_token,
                                   images=ImageLimits(allow_urls=args.allow_image_urls, max_bytes=args.image_max_bytes,
                                                      timeout_s=args.image_fetch_timeout))
        app = create_app(settings)
    except (FileNotFoundError, ValueError) as exc:
        print(f"serve-gateway: {exc}", file=sys.stderr)
        return 2
    # uvicorn's access log is replaced by our one line per generation request (id, status, tokens, latency). h11's
    # own bound on a request head sits above ours, so oversized headers get our OpenAI-shaped 431.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
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
