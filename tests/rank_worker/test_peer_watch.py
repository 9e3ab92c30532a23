"""The peer watchdog as real processes: a rank whose peer is killed or frozen leaves with exit code 5 in time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.rank_worker.distributed import free_port
from services.rank_worker.peer_watch import EXIT_PEER_LOST

CHILD = str(Path(__file__).with_name("peer_watch_child.py"))
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


def _start_group(tmp_path: Path, world: int, timeout_s: float) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for r in range(world):
        log = open(tmp_path / f"rank{r}.log", "w")
        procs.append(subprocess.Popen([sys.executable, CHILD, str(r), str(world), str(port), str(timeout_s)],
                                      cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"}))
    deadline = time.monotonic() + 30
    while not all("watching" in (tmp_path / f"rank{r}.log").read_text() for r in range(world)):
        assert time.monotonic() < deadline, "the watchdog star did not connect"
        assert all(p.poll() is None for p in procs), "a watchdog exited while connecting"
        time.sleep(0.05)
    return procs


def _cleanup(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.wait()


def test_killed_peer_makes_the_others_exit_at_once(tmp_path):
    procs = _start_group(tmp_path, 3, timeout_s=3.0)
    try:
        time.sleep(1.0)  # some heartbeats go by: a live peer is not mistaken for a lost one
        assert all(p.poll() is None for p in procs)
        t = time.monotonic()
        procs[1].kill()
        assert procs[0].wait(timeout=5) == EXIT_PEER_LOST
        took = time.monotonic() - t
        # rank 2 only talks to rank 0, so it learns through rank 0 leaving.
        assert procs[2].wait(timeout=5) == EXIT_PEER_LOST
    finally:
        _cleanup(procs)
    assert took < 2.0, f"rank0 took {took:.1f} s to notice a killed peer (EOF should be immediate)"
    # Closed or reset (the killed process had heartbeats unread), never "silent": that would take the timeout.
    assert "lost rank 1 (connection " in (tmp_path / "rank0.log").read_text()
    assert "leaving the group so the supervisor restarts it" in (tmp_path / "rank0.log").read_text()
    assert "lost rank 0 (connection " in (tmp_path / "rank2.log").read_text()


def test_frozen_peer_is_lost_after_the_timeout(tmp_path):
    procs = _start_group(tmp_path, 2, timeout_s=1.5)
    try:
        t = time.monotonic()
        os.kill(procs[1].pid, signal.SIGSTOP)
        assert procs[0].wait(timeout=5) == EXIT_PEER_LOST
        took = time.monotonic() - t
        os.kill(procs[1].pid, signal.SIGCONT)  # thawed, it finds rank 0 gone and leaves too
        assert procs[1].wait(timeout=5) == EXIT_PEER_LOST
    finally:
        _cleanup(procs)
    assert took >= 1.0, f"rank0 gave up on a frozen peer after {took:.1f} s, before its 1.5 s timeout"
    assert "lost rank 1 (silent for 1.5 s)" in (tmp_path / "rank0.log").read_text()
    assert "lost rank 0 (" in (tmp_path / "rank1.log").read_text()  # EOF or a failed heartbeat, whichever is first
