"""Arrival counters for launches whose last program to finish does the rest (the GEMM's split-K sum, KDA decode's
history write and gated norm): one int32 table per device, zeroed once. Every launch leaves the counters it used
at zero again (the last arrival resets its own), and launches on a device run one after another on the forward's
stream (or in its CUDA graphs), so every such kernel shares the one table."""

from __future__ import annotations

import torch

_TABLES: dict[torch.device, torch.Tensor] = {}
LIMIT = 1 << 20


def counters(device: torch.device, n: int, what: str) -> torch.Tensor:
    """The device's table, for a launch that needs `n` counters from its start (`what` names them in the error)."""
    if n > LIMIT:
        raise ValueError(f"a launch of {n} {what} exceeds the {LIMIT} arrival counters")
    if device not in _TABLES:
        _TABLES[device] = torch.zeros(LIMIT, dtype=torch.int32, device=device)
    return _TABLES[device]
