"""Listen addresses as clients reach them. Standard library only: deploy/ctl imports ports.py, which needs them."""

from __future__ import annotations

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def client_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host`."""
    if host in WILDCARD_HOSTS:
        return "::1" if ":" in host else "127.0.0.1"
    return host.strip("[]")


def bracket(host: str) -> str:
    """`host` as it goes before `:port` (an IPv6 address in brackets)."""
    host = host.strip("[]")
    return f"[{host}]" if ":" in host else host
