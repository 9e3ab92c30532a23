"""`twinspark serve-scheduler`: the scheduler in front of a group of rank workers.

Every flag defaults from a TWINSPARK_* environment variable, so a compose file / .env can configure it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from services.common.env import add_internal_token_flag, env


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve-scheduler", help="run the scheduler (queue, batching, KV pool) in front of the rank workers",
        description="Describe every rank, check they form one group, then serve the Generator gRPC service "
                    "(Generate / Abort / Health) to the gateway. Flags default from TWINSPARK_* variables.")
    ranks = env("RANKS")
    p.add_argument("--ranks", default=ranks, required=ranks is None,
                   help="rank worker addresses host:port,host:port in rank order (TWINSPARK_RANKS)")
    p.add_argument("--host", default=env("SCHEDULER_HOST", "127.0.0.1"),
                   help="listen address (TWINSPARK_SCHEDULER_HOST, default loopback; another address needs "
                        "--internal-token)")
    p.add_argument("--port", type=int, default=int(env("SCHEDULER_PORT", "50051")),
                   help="listen port (TWINSPARK_SCHEDULER_PORT, default 50051)")
    p.add_argument("--max-waiting", type=int, default=int(env("MAX_WAITING", "64")),
                   help="waiting-queue bound; beyond it Generate answers RESOURCE_EXHAUSTED + retry-after "
                        "(TWINSPARK_MAX_WAITING, default 64)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=int(env("MAX_NUM_SEQS", "16")),
                   help="running requests at most (also capped by the ranks' KDA slots) (TWINSPARK_MAX_NUM_SEQS, "
                        "default 16)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int,
                   default=int(env("MAX_NUM_BATCHED_TOKENS", "256")),
                   help="token budget of one round: decode rows first, then prefill chunks "
                        "(TWINSPARK_MAX_NUM_BATCHED_TOKENS, default 256)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=env("ENABLE_PREFIX_CACHING", "1").lower() not in ("0", "false", "no", "off"),
                   help="reuse cached prompt prefixes (full blocks + KDA state snapshots) across requests "
                        "(TWINSPARK_ENABLE_PREFIX_CACHING, default on)")
    p.add_argument("--reply-reuse", action=argparse.BooleanOptionalAction,
                   default=env("REPLY_REUSE", "1").lower() not in ("0", "false", "no", "off"),
                   help="after each reply, prefill prompt + reply up to its last 64-token grid point in the "
                        "background and snapshot it, so the conversation's next turn resumes there "
                        "(TWINSPARK_REPLY_REUSE, default on; needs prefix caching)")
    snaps = env("MAX_SNAPSHOTS")
    p.add_argument("--max-snapshots", type=int, default=int(snaps) if snaps else None,
                   help="KDA state snapshot slots for the prefix cache, reserved from the ranks' --num-slots "
                        "(~142 MB each per rank at full size) (TWINSPARK_MAX_SNAPSHOTS, default: the slots left "
                        "after --max-num-seqs, at most 16)")
    p.add_argument("--startup-timeout", type=float, default=float(env("STARTUP_TIMEOUT", "300")),
                   help="seconds to wait for every rank to answer Describe (TWINSPARK_STARTUP_TIMEOUT, default 300)")
    p.add_argument("--rank-timeout", type=float, default=float(env("RANK_TIMEOUT", "300")),
                   help="seconds one round may take before the rank is declared hung; 0 = never "
                        "(TWINSPARK_RANK_TIMEOUT, default 300)")
    p.add_argument("--drafter", default=env("DRAFTER") or None,
                   help="drafter address host:port; unset = no drafts (TWINSPARK_DRAFTER)")
    p.add_argument("--num-draft-tokens", type=int, default=int(env("NUM_DRAFT_TOKENS", "4")),
                   help="drafts asked per decoding request and round (TWINSPARK_NUM_DRAFT_TOKENS, default 4)")
    p.add_argument("--draft-timeout", type=float, default=float(env("DRAFT_TIMEOUT", "0.5")),
                   help="seconds a Propose may take; slower rounds go on without drafts (default 0.5)")
    p.add_argument("--draft-hidden", action="store_true", default=env("DRAFT_HIDDEN", "") in ("1", "true"),
                   help="ask the ranks for hidden states and pass them to the drafter (MTP drafts)")
    p.add_argument("--tokenizer", default=env("TOKENIZER") or None,
                   help="checkpoint directory (or tokenizer.json) whose tokenizer the grammar masks of structured "
                        "output use; unset = structured output is refused (TWINSPARK_TOKENIZER)")
    add_internal_token_flag(p)
    p.add_argument("--log-level", default=env("LOG_LEVEL", "INFO"), help="TWINSPARK_LOG_LEVEL, default INFO")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.common.internal_auth import check_bind
    from services.common.telemetry import setup_tracing
    from services.scheduler.engine import EngineConfig
    from services.scheduler.ranks import StartupError
    from services.scheduler.server import SchedulerConfig, serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s scheduler %(levelname)s %(name)s: %(message)s")
    try:
        check_bind(args.host, args.internal_token)
    except ValueError as exc:
        logging.getLogger("twinspark.scheduler").error("%s", exc)
        return 2
    setup_tracing("twinspark-scheduler")
    addresses = [a.strip() for a in args.ranks.split(",") if a.strip()]
    if not addresses:
        logging.getLogger("twinspark.scheduler").error("--ranks lists no addresses")
        return 2
    cfg = SchedulerConfig(
        ranks=addresses, host=args.host, port=args.port,
        engine=EngineConfig(max_waiting=args.max_waiting, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            enable_prefix_caching=args.enable_prefix_caching, max_snapshots=args.max_snapshots,
                            reply_reuse=args.reply_reuse,
                            num_draft_tokens=max(0, args.num_draft_tokens), draft_hidden=args.draft_hidden),
        drafter=args.drafter, draft_timeout_s=args.draft_timeout, tokenizer=args.tokenizer,
        internal_token=args.internal_token,
        startup_timeout_s=args.startup_timeout, rank_timeout_s=args.rank_timeout or None)
    try:
        asyncio.run(serve(cfg))
    except StartupError as exc:
        logging.getLogger("twinspark.scheduler").error("refusing to start: %s", exc)
        return 3
    except OSError as exc:
        logging.getLogger("twinspark.scheduler").error("%s", exc)
        return 2
    except ValueError as exc:  # settings the ranks cannot honour, e.g. --max-snapshots >= their KDA slots
        logging.getLogger("twinspark.scheduler").error("refusing to start: %s", exc)
        return 2
    return 0
