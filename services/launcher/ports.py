"""Free ports for the internal listeners, and a check that the public port is not taken."""

from __future__ import annotations

import contextlib
import socket

from .plan import client_host


def free_ports(n: int, host: str = "127.0.0.1", exclude: tuple[int, ...] = ()) -> list[int]:
    """`n` distinct ports that were free on `host` a moment ago.

    All sockets are held open together while picking, so the ports are distinct; they are closed before the
    children bind them, so another program could take one in between (then that child fails to bind, exits, and
    `up` reports it with its log).
    """
    socks: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < n:
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in exclude and port not in ports:
                ports.append(port)
        return ports
    finally:
        for s in socks:
            s.close()


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
