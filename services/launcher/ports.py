"""Free ports for the internal listeners (services/common/ports.py picks them), and a check that the public port is
not taken."""

from __future__ import annotations

import contextlib
import socket

from services.common.ports import free_ports

from .addresses import client_host

__all__ = ["free_ports", "listening", "port_free"]


def port_free(host: str, port: int) -> bool:
    """True when a server could bind `host:port` now (SO_REUSEADDR, like uvicorn/gRPC do)."""
    bind_host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind_host, port))
        except OSError:
            return False
    return True


def listening(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections on `host:port` (a wildcard host is probed on loopback)."""
    with contextlib.suppress(OSError), socket.create_connection((client_host(host), port), timeout=timeout):
        return True
    return False
