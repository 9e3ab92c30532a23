"""`twinspark serve-drafter`: propose draft tokens to the scheduler (copy / mtp / dflash2)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from services.common import shared_flags as shared
from services.common.flags import add_subcommand, flag
from services.common.role_start import RoleSettings, start_role

log = logging.getLogger("twinspark.drafter")


@dataclass(frozen=True, kw_only=True)
class DrafterSettings(RoleSettings):
    host: str = flag("host", "gRPC listen address (default loopback; another address needs --internal-token)",
                     default="127.0.0.1", env="DRAFTER_HOST")
    port: int = flag("port", "gRPC port", default="50061", type=int, env="DRAFTER_PORT")
    method: str = flag("method", "copy: n-gram prompt lookup; mtp: the checkpoint's MTP layer; dflash2: a DFlash2 "
                       "block drafter from user-supplied weights", default="copy", choices=("copy", "mtp", "dflash2"),
                       env="DRAFT_METHOD")
    model: str | None = flag(shared.MODEL, help="checkpoint directory (mtp; dflash2: the target, for its embedding "
                             "and lm_head)")
    device: str = flag(shared.DEVICE)
    mtp_threshold: float = flag("mtp-threshold", "mtp: keep chaining drafts while the top probability is >= this "
                                "(default 0: up to K)", default="0", type=float)
    mtp_history: int = flag("mtp-history", "mtp: (hidden, token) pairs kept per request and recomputed each call "
                            "(default 64)", default="64", type=int)
    dflash2_weights: str | None = flag("dflash2-weights", "dflash2: the drafter's folder (config.json + safetensors; "
                                       "user-supplied, not shipped)", env=None)


def register(sub: argparse._SubParsersAction) -> None:
    add_subcommand(sub, "serve-drafter", DrafterSettings, serve_drafter,
                   help="run the drafter (speculative draft tokens for the scheduler)",
                   description="Serve the Drafter gRPC service. copy: n-gram prompt lookup over each request's own "
                               "tokens (CPU, no model); mtp: the checkpoint's MTP layer fed the target's last hidden "
                               "state; dflash2: a DFlash2 block drafter (user-supplied weights, not shipped) fed the "
                               "target layers' outputs.")


def serve_drafter(s: DrafterSettings) -> int:
    from services.drafter.methods import DraftMethodUnavailable, build
    from services.drafter.server import serve_forever

    if not start_role("drafter", s, listen=s.host):
        return 2
    kw = {}
    if s.method == "mtp":
        kw = dict(threshold=s.mtp_threshold, history=s.mtp_history, device=s.device)
    elif s.method == "dflash2":
        kw = dict(weights=s.dflash2_weights, device=s.device)
    try:
        method = build(s.method, s.model, **kw)
    except DraftMethodUnavailable as exc:
        log.error("%s", exc)
        return 2
    try:
        serve_forever(method, s.host, s.port, s.internal_token)
    except OSError as exc:
        log.error("%s", exc)
        return 2
    return 0
