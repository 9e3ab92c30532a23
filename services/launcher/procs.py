"""Process and process-group probes without psutil: signals, plus Linux /proc where it makes the answer exact
(zombies count as gone; a pid reused by another program is told apart by its start time)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

_PROC = Path("/proc")


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (index 0 = state, 2 = pgrp, 19 = starttime)."""
    try:
        raw = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2:].split()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None where /proc is missing or the pid is gone)."""
    f = _stat(pid)
    return int(f[19]) if f else None


def alive(pid: int, started: int | None = None) -> bool:
    """True when `pid` runs (not a zombie) and, if `started` is given and knowable, is the same process."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    f = _stat(pid)
    if f is None:
        return not _PROC.is_dir()  # no /proc on this system: trust kill(0); else it vanished just now
    if f[0] in ("Z", "X"):
        return False
    return started is None or int(f[19]) == started


def live_groups(pgids: "set[int] | list[int]") -> set[int]:
    """The process groups among `pgids` that still have a live (non-zombie) member; one /proc scan for all."""
    wanted = {g for g in pgids if g > 0}
    if not wanted:
        return set()
    if not _PROC.is_dir():
        out = set()
        for g in wanted:
            try:
                os.killpg(g, 0)
            except (ProcessLookupError, PermissionError):
                continue
            out.add(g)
        return out
    found: set[int] = set()
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            f = _stat(int(entry.name))
            if f and f[0] not in ("Z", "X") and int(f[2]) in wanted:
                found.add(int(f[2]))
    return found


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to every process in group `pgid`; False if the group is gone."""
    if pgid <= 0:
        return False
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
