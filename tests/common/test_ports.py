"""services/common/ports.py: listener ports come from outside the kernel's ephemeral range, distinct and bindable,
and the picker still answers when that range is all there is."""

from __future__ import annotations

import socket

from services.common import ports


def test_ports_avoid_the_ephemeral_range_and_bind():
    low, high = ports.ephemeral_range()
    picked = ports.free_ports(8, exclude=(ports.LOWEST,))
    assert len(set(picked)) == 8 and ports.LOWEST not in picked
    assert all(not low <= p <= high and ports.LOWEST <= p <= ports.HIGHEST for p in picked)
    for p in picked:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_never_picked(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setattr(ports, "candidates", lambda: [taken])
        picked = ports.free_ports(2)
    assert taken not in picked and len(set(picked)) == 2  # the kernel's choice, when no candidate binds
