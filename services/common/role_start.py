"""What every serving role does first: its log format, the bind check of an internal gRPC port, tracing."""

from __future__ import annotations

import logging


def start_role(name: str, log_level: str, *, host: str | None = None, internal_token: str | None = None,
               log_format: str | None = None) -> bool:
    """Set up logging and tracing for role `name` (its spans' service is twinspark-NAME). With `host`, first refuse
    (False, logged) an internal server listening beyond loopback without an internal token."""
    logging.basicConfig(level=log_level.upper(),
                        format=log_format or f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    if host is not None:
        from services.common.internal_auth import check_bind

        try:
            check_bind(host, internal_token)
        except ValueError as exc:
            logging.getLogger(f"twinspark.{name}").error("%s", exc)
            return False
    from services.common.telemetry import setup_tracing

    setup_tracing(f"twinspark-{name}")
    return True
