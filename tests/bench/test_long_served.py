"""bench/long_served.py: a long prompt served beside a decoding stream, end to end on the CPU (make-tiny dims),
and its gap statistics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.long_served import gap_stats, longest_prompt_round

ROOT = Path(__file__).resolve().parents[2]


def test_gap_stats_counts_only_the_window() -> None:
    arrivals = [0.0, 0.010, 0.020, 0.050, 1.050, 1.060]
    s = gap_stats(arrivals, 0.005, 1.055)  # chunks 0.010 .. 1.050: gaps 10, 30, 1000 ms
    assert s["chunks"] == 4 and s["p50_ms"] == 30.0 and s["max_ms"] == 1000.0
    assert gap_stats(arrivals, 2.0, 3.0) == {"chunks": 0}


def test_longest_prompt_round_reads_gpu_and_host_figures() -> None:
    lines = ["rank 0: rounds 1-9 in 2.0 s (4.5/s): host launch p50 2.00 ms (8 of 9 behind the previous round), "
             "read-back wait p50 0.02 ms, plan wait 0.00 s; 2 with prompt rows: GPU p50 280.10 / max 811.00 ms, host "
             "launch p50 30.00 / max 41.50 ms, read-back wait p50 0.02 / max 0.04 ms",
             "rank 0: rounds 10-12 in 2.0 s (1.5/s): host launch p50 2.00 ms (3 of 3 behind the previous round)",
             "rank 0: rounds 13-14 in 2.0 s (1.0/s): host launch p50 9.00 ms (0 of 2 behind the previous round), "
             "read-back wait p50 0.00 ms, plan wait 0.00 s; 1 with prompt rows: host launch p50 50.00 / max 50.00 ms"]
    assert longest_prompt_round(lines) == {"gpu_max_ms": 811.0, "launch_max_ms": 50.0}
    assert longest_prompt_round(lines[1:2]) == {"gpu_max_ms": None, "launch_max_ms": None}


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
    # rank 0's round stats over the prefill name its longest prompt round (host launch only: no GPU events here)
    assert data["rank_stats"] and data["longest_prompt_round"]["launch_max_ms"] > 0
    assert data["longest_prompt_round"]["gpu_max_ms"] is None
    assert "Longest prompt round during the prefill" in path.with_suffix(".md").read_text()
