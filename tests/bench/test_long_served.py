"""bench/long_served.py: a long prompt served beside a decoding stream, end to end on the CPU (make-tiny dims),
and its gap statistics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.long_served import gap_stats

ROOT = Path(__file__).resolve().parents[2]


def test_gap_stats_counts_only_the_window() -> None:
    arrivals = [0.0, 0.010, 0.020, 0.050, 1.050, 1.060]
    s = gap_stats(arrivals, 0.005, 1.055)  # chunks 0.010 .. 1.050: gaps 10, 30, 1000 ms
    assert s["chunks"] == 4 and s["p50_ms"] == 30.0 and s["max_ms"] == 1000.0
    assert gap_stats(arrivals, 2.0, 3.0) == {"chunks": 0}


def test_long_served_tiny_end_to_end(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench.long_served", "--tiny", "--device", "cpu", "--length", "1024", "--budget",
           "256", "--stream-tokens", "400", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("long_served-*.json")
    data = json.loads(path.read_text())
    assert data["long"]["status"] == 200 and data["long"]["ttft_s"] > 0
    assert data["long"]["usage"]["prompt_tokens"] == 1024 and data["stream_error"] is None
    # the stream kept decoding while the prompt prefilled in budget-sized rounds (1,024 / 256 = at least 4 rounds)
    assert data["gaps_before"]["chunks"] >= 100 and data["gaps_during"]["chunks"] >= 2
    assert "offline_ttft_s" not in data  # --offline defaults off on the CPU
    assert "| TTFT s |" in path.with_suffix(".md").read_text()
