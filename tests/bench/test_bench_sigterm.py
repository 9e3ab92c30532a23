"""A bench stopped by SIGTERM (`timeout`, a job runner) takes down the stack it started (bench/stack.py), while that
stack starts or once it serves: before, the stack outlived the bench and held the GPU for the next run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.launcher.procs import alive

ROOT = Path(__file__).resolve().parents[2]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("when", ["starting", "serving"])
def test_sigterm_stops_the_stack_the_bench_started(tiny_default: Path, tmp_path: Path, when: str) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path), "TWINSPARK_MAX_MODEL_LEN": "256"}
    bench = subprocess.Popen([sys.executable, "-m", "bench.soak", "--tp", "1", "--model", str(tiny_default),
                              "--duration", "300", "--clients", "1", "--out", str(tmp_path / "out")], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not list(tmp_path.glob("twinspark-bench-*/up.json")):
            assert bench.poll() is None and time.monotonic() < deadline, bench.stderr.read()[-2000:]
            time.sleep(0.5)
        up = json.loads(next(tmp_path.glob("twinspark-bench-*/up.json")).read_text())
        supervisor = up["supervisor_pid"]
        while when == "serving" and not _healthy(up["health_url"]):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        time.sleep(3 if when == "serving" else 0)  # the bench's client is sending by then
        assert alive(supervisor)
        bench.send_signal(signal.SIGTERM)
        bench.wait(timeout=120)
        deadline = time.monotonic() + 30
        while alive(supervisor) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(supervisor), "the stack outlived the bench"
    finally:
        if bench.poll() is None:
            bench.kill()
