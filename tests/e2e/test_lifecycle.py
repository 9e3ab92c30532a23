"""Start, health and stop of the whole stack: a killed rank turns /health unhealthy; `down` leaves no process."""

from __future__ import annotations

import os
import signal

import httpx

from tests.e2e.stack import pids_alive, start, wait_until


def test_killed_rank_makes_health_unhealthy_and_down_cleans_up(tiny_default, tmp_path):
    stack = start(tiny_default, tmp_path / "state", tp=2)
    info = stack.up_json()
    supervisor = info["supervisor_pid"]
    pids = [c["pid"] for c in info["children"]] + [supervisor]
    rank1 = next(c for c in info["children"] if c["name"] == "rank1")
    try:
        # Freeze the supervisor so it cannot tear the stack down before we look: this checks what /health itself
        # reports about a dead rank.
        os.kill(supervisor, signal.SIGSTOP)
        os.kill(rank1["pid"], signal.SIGKILL)

        def reports_rank1_down() -> bool:
            r = httpx.get(stack.url + "/health", timeout=5)
            return r.status_code == 503 and "rank1" in r.json().get("down", [])

        assert wait_until(reports_rank1_down, timeout=20)
        # A request now gets 503, not silence.
        r = httpx.post(stack.v1 + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["message"]
    finally:
        os.kill(supervisor, signal.SIGCONT)
        out = stack.down()
    assert out.returncode == 0, out.stderr
    assert wait_until(lambda: not pids_alive(pids), timeout=30), f"left behind: {pids_alive(pids)}"
