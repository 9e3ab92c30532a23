"""Ports for listeners a process is about to start, drawn outside the kernel's range for outgoing connections.

Asking the kernel for port 0 returns a port of its ephemeral range, the same range it gives every client socket's
local end. A port picked that way and closed before its server binds it is often taken in between by one of the
many client connections a busy host makes (the test suite saw `Address already in use` that way). Ports outside
that range are handed out only to programs that ask for them by number, so the window is left to those.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Where candidates come from: above the well-known and common service ports, below 65536.
LOWEST = 10000
HIGHEST = 65535
_EPHEMERAL_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_IANA_EPHEMERAL = (49152, 65535)  # what BSD / macOS / Windows use (no file says so there)
_ATTEMPTS = 400


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux's file; IANA's range elsewhere)."""
    try:
        low, high = (int(v) for v in _EPHEMERAL_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return _IANA_EPHEMERAL


def candidates() -> list[int]:
    """Every port a listener may be given: LOWEST..HIGHEST less the ephemeral range."""
    low, high = ephemeral_range()
    return [p for p in range(LOWEST, HIGHEST + 1) if not low <= p <= high]


def free_ports(n: int, host: str = "127.0.0.1", exclude: tuple[int, ...] = ()) -> list[int]:
    """`n` distinct ports that were free on `host` a moment ago, outside the ephemeral range.

    Drawn at random (two launches at once rarely meet) and bound while picking, so they are distinct; they are
    closed before the children bind them, so another program could still take one in between (then that child
    fails to bind, exits, and its launcher reports it). Falls back to the kernel's choice when nothing outside the
    ephemeral range binds (a host that reserves it all)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    pool = [p for p in candidates() if p not in exclude]
    rng = random.Random()
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        for port in rng.sample(pool, min(len(pool), _ATTEMPTS)):
            if len(ports) == n:
                break
            s = socket.socket(family, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
        while len(ports) < n:  # the kernel's choice, as a last resort
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in exclude and port not in ports:
                ports.append(port)
        return ports
    finally:
        for s in socks:
            s.close()
