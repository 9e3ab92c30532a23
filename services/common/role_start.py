"""What every serving role shares: the flags each takes alike, and what it does first (its log format, the bind
check of an internal gRPC port, tracing).

Standard library only at import (the settings dataclasses that extend `RoleSettings` are read by deploy/ctl)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from services.common import shared_flags as shared
from services.common.flags import flag


@dataclass(frozen=True, kw_only=True)
class RoleSettings:
    """The flags of every role (rank, drafter, scheduler, gateway): the run's internal token (an internal server
    requires it, a client sends it) and the log level. A role's settings dataclass extends this one."""

    internal_token: str | None = flag(shared.INTERNAL_TOKEN)
    log_level: str = flag(shared.LOG_LEVEL)


def start_role(name: str, s: RoleSettings, *, listen: str | None = None, log_format: str | None = None) -> bool:
    """Set up logging and tracing for role `name` (its spans' service is twinspark-NAME). With `listen` (an internal
    server's listen address), first refuse (False, logged) one beyond loopback without an internal token."""
    logging.basicConfig(level=s.log_level.upper(),
                        format=log_format or f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    if listen is not None:
        from services.common.internal_auth import check_bind

        try:
            check_bind(listen, s.internal_token)
        except ValueError as exc:
            logging.getLogger(f"twinspark.{name}").error("%s", exc)
            return False
    from services.common.telemetry import setup_tracing

    setup_tracing(f"twinspark-{name}")
    return True
