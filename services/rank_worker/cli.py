"""`twinspark serve-rank`: one rank worker (one per GPU / machine). The flags are RankSettings' (settings.py), the
boot sequence is boot.py's."""

from __future__ import annotations

import argparse

from services.common.flags import add_flags, from_args
from services.rank_worker.settings import RankSettings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-rank", help="run one rank worker (one per GPU / machine)",
                       description="Join the tensor-parallel group, load this rank's shard and serve StepPlans over "
                                   "gRPC. Flags default from TWINSPARK_* environment variables.")
    add_flags(RankSettings, p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.rank_worker.boot import serve_rank

    return serve_rank(from_args(RankSettings, args))
