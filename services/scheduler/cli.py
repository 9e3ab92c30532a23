"""`twinspark serve-scheduler`: the scheduler in front of a group of rank workers.

Every flag defaults from a TWINSPARK_* environment variable, so a compose file / .env can configure it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass

from services.common import shared_flags as shared
from services.common.flags import add_subcommand, flag
from services.common.role_start import RoleSettings, start_role

log = logging.getLogger("twinspark.scheduler")


@dataclass(frozen=True, kw_only=True)
class SchedulerSettings(RoleSettings):
    ranks: str = flag("ranks", "rank worker addresses host:port,host:port in rank order", required=True)
    host: str = flag("host", "listen address (default loopback; another address needs --internal-token)",
                     default="127.0.0.1", env="SCHEDULER_HOST")
    port: int = flag("port", "listen port (default 50051)", default="50051", type=int, env="SCHEDULER_PORT")
    max_waiting: int = flag(shared.MAX_WAITING)
    max_num_seqs: int = flag(shared.MAX_NUM_SEQS)
    max_num_batched_tokens: int | None = flag(shared.MAX_NUM_BATCHED_TOKENS)
    num_scheduler_steps: int = flag(shared.NUM_SCHEDULER_STEPS)
    enable_prefix_caching: bool = flag("enable-prefix-caching", "reuse cached prompt prefixes (full blocks + KDA "
                                       "state snapshots) across requests (default on)", default="1", toggle=True)
    reply_reuse: bool = flag("reply-reuse", "after each reply, prefill prompt + reply up to its last 64-token grid "
                             "point in the background and snapshot it, so the conversation's next turn resumes there "
                             "(default on; needs prefix caching)", default="1", toggle=True)
    reply_reuse_delay: float = flag("reply-reuse-delay", "seconds with no request running or waiting before a reply "
                                    "replay starts, so it never delays users' rows (default 0.5)", default="0.5",
                                    type=float)
    max_snapshots: int | None = flag("max-snapshots", "KDA state snapshot slots for the prefix cache, reserved from "
                                     "the ranks' --num-slots (~142 MB each per rank at full size) (default: the "
                                     "slots left after --max-num-seqs, at most 16)", type=int)
    startup_timeout: float = flag("startup-timeout", "seconds to wait for every rank to answer Describe (default "
                                  "300)", default="300", type=float)
    rank_timeout: float = flag("rank-timeout", "seconds one round may take before the rank is declared hung; 0 = "
                               "never (default 300)", default="300", type=float)
    # Its own variable: `twinspark up`'s TWINSPARK_DRAFTER is a draft method ("none", "copy", ...), and up's children
    # inherit its environment, so a shared name read "none" as an address and planned rounds for a phantom drafter.
    drafter: str | None = flag("drafter", "drafter address host:port; unset = no drafts", env="DRAFTER_ADDRESS")
    num_draft_tokens: int = flag(shared.NUM_DRAFT_TOKENS)
    draft_timeout: float = flag("draft-timeout", "seconds a Propose may take; slower rounds go on without drafts "
                                "(default 0.5)", default="0.5", type=float)
    draft_hidden: bool = flag("draft-hidden", "ask the ranks for hidden states and pass them to the drafter (MTP "
                              "drafts)", switch=True)
    draft_layers: str | None = flag("draft-layers", "comma-separated target layers (0-based) whose outputs the ranks "
                                    "return for every row and the drafter is sent by position (DFlash drafts; `up "
                                    "--drafter dflash` passes the drafter config's target_layer_ids)")
    tokenizer: str | None = flag("tokenizer", "checkpoint directory (or tokenizer.json) whose tokenizer the grammar "
                                 "masks of structured output use; unset = structured output is refused")
    kv_events_endpoint: str | None = flag(shared.KV_EVENTS_ENDPOINT)


def register(sub: argparse._SubParsersAction) -> None:
    add_subcommand(sub, "serve-scheduler", SchedulerSettings, serve_scheduler,
                   help="run the scheduler (queue, batching, KV pool) in front of the rank workers",
                   description="Describe every rank, check they form one group, then serve the Generator gRPC "
                               "service (Generate / Abort / Health) to the gateway. Flags default from TWINSPARK_* "
                               "variables.")


def serve_scheduler(s: SchedulerSettings) -> int:
    from services.scheduler.ranks import StartupError
    from services.scheduler.server import SchedulerConfig, serve

    if not start_role("scheduler", s, listen=s.host):
        return 2
    try:
        cfg = SchedulerConfig.from_settings(s)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    try:
        asyncio.run(serve(cfg))
    except StartupError as exc:
        log.error("refusing to start: %s", exc)
        return 3
    except OSError as exc:
        log.error("%s", exc)
        return 2
    except ValueError as exc:  # settings the ranks cannot honour, e.g. --max-snapshots >= their KDA slots
        log.error("refusing to start: %s", exc)
        return 2
    return 0
