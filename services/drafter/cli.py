"""`twinspark serve-drafter`: propose draft tokens to the scheduler (copy / mtp / dflash2)."""

from __future__ import annotations

import argparse
import logging

from services.common.env import add_internal_token_flag, env


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve-drafter", help="run the drafter (speculative draft tokens for the scheduler)",
        description="Serve the Drafter gRPC service. copy: n-gram prompt lookup over each request's own tokens "
                    "(CPU, no model); mtp: the checkpoint's MTP layer fed the target's last hidden state; dflash2: "
                    "needs user-supplied weights (not shipped).")
    p.add_argument("--host", default=env("DRAFTER_HOST", "127.0.0.1"),
                   help="gRPC listen address (TWINSPARK_DRAFTER_HOST; default loopback; another address needs "
                        "--internal-token)")
    p.add_argument("--port", type=int, default=int(env("DRAFTER_PORT", "50061")))
    p.add_argument("--method", default=env("DRAFT_METHOD", "copy"), choices=["copy", "mtp", "dflash2"])
    p.add_argument("--model", default=env("MODEL"), help="checkpoint directory (mtp)")
    p.add_argument("--device", default=env("DEVICE", "cpu"), choices=["cpu", "cuda"])
    p.add_argument("--mtp-threshold", type=float, default=float(env("MTP_THRESHOLD", "0.0")),
                   help="mtp: keep chaining drafts while the top probability is >= this (default 0: up to K)")
    p.add_argument("--mtp-history", type=int, default=int(env("MTP_HISTORY", "64")),
                   help="mtp: (hidden, token) pairs kept per request and recomputed each call (default 64)")
    p.add_argument("--dflash2-weights", default=None, help="dflash2: user-supplied weights (not shipped)")
    add_internal_token_flag(p)
    p.add_argument("--log-level", default=env("LOG_LEVEL", "INFO"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.common.internal_auth import check_bind
    from services.common.telemetry import setup_tracing
    from services.drafter.methods import DraftMethodUnavailable, build
    from services.drafter.server import serve_forever

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s drafter %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("twinspark.drafter")
    try:
        check_bind(args.host, args.internal_token)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    setup_tracing("twinspark-drafter")
    kw = {}
    if args.method == "mtp":
        kw = dict(threshold=args.mtp_threshold, history=args.mtp_history, device=args.device)
    elif args.method == "dflash2":
        kw = dict(weights=args.dflash2_weights)
    try:
        method = build(args.method, args.model, **kw)
    except DraftMethodUnavailable as exc:
        log.error("%s", exc)
        return 2
    try:
        serve_forever(method, args.host, args.port, args.internal_token)
    except OSError as exc:
        log.error("%s", exc)
        return 2
    return 0
