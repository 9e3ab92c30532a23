"""Flag defaults from the environment: every `--flag` of a service defaults from `TWINSPARK_<NAME>`."""

from __future__ import annotations

import argparse
import os


def env(name: str, default: str | None = None) -> str | None:
    """The value of TWINSPARK_<name>, or `default` when unset."""
    return os.environ.get(f"TWINSPARK_{name}", default)


def add_internal_token_flag(parser: argparse.ArgumentParser) -> None:
    """`--internal-token` of every role that serves or calls an internal gRPC port."""
    parser.add_argument("--internal-token", default=env("INTERNAL_TOKEN") or None, metavar="TOKEN",
                        help="shared secret that every internal gRPC call carries and every internal server requires "
                             "(env TWINSPARK_INTERNAL_TOKEN, preferred: an argv is visible to other local users; "
                             "`twinspark up` and start.sh make one per run); unset = no check, loopback only")
