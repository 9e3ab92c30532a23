"""bench/trace_gaps.py on a small hand-made Chrome trace: GPU busy time as the union of kernel intervals, the idle
gaps by size, and the per-launch figures (the command the whole-model notes read a profile with)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.chrome_trace import merged
from bench.trace_gaps import report

ROOT = Path(__file__).resolve().parents[2]


def _trace() -> list[dict]:
    """Two decode rounds: a graph launch each, kernels (two overlapping) and a 1.5 ms idle gap between rounds."""
    def x(cat: str, name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    return [x("cuda_runtime", "cudaGraphLaunch", 0, 50), x("cuda_runtime", "cudaGraphLaunch", 2000, 40),
            x("kernel", "_gemm_kernel", 100, 100), x("kernel", "_gemm_kernel", 150, 100),  # overlap: 150 us busy
            x("kernel", "_down_kernel", 253, 47),  # a 3 us gap
            x("kernel", "_gemm_kernel", 1800, 200), x("gpu_memcpy", "Memcpy DtoH", 2000, 4),
            {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5}]  # not a complete event: ignored


def test_merged_joins_overlapping_intervals() -> None:
    assert merged([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]


def test_report_counts_busy_idle_and_gaps() -> None:
    text = report(_trace(), top=5)
    # busy: [100, 250) + [253, 300) + [1800, 2004) = 150 + 47 + 204 = 401 us in a 1904 us window
    assert "window 1.90 ms" in text and "GPU busy 0.40 ms (21.1%)" in text and "idle 1.50 ms" in text
    assert "per CUDA graph launch (2): busy 0.201 ms" in text
    assert "| < 5 us | 1 | 0.003 |" in text and "| >= 1000 us | 1 | 1.500 |" in text
    assert "| `_gemm_kernel` | 0.400 | 3 | 1.5 | 133.33 |" in text
    assert "| `cudaGraphLaunch` | 0.090 | 2 | 1.0 | 45.00 |" in text


def test_report_says_what_the_collective_costs() -> None:
    def x(name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}
    events = [x("_gemm_kernel", 0, 80), x("_exchange_kernel", 80, 20), x("ncclDevKernel_AllGather", 200, 100)]
    text = report(events + [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 5}], 5)
    assert "in collectives: 0.120 ms = 60.0% of GPU busy (0.120 ms per CUDA graph launch)" in text
    assert "in collectives" not in report(_trace(), top=5)  # none in a TP 1 trace


def test_collective_time_splits_into_transfer_skew_and_wait() -> None:
    def x(name: str, ts: float, dur: float, corr: int) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}
    # two launches (correlation 1 and 2); the fastest call is 10 us; the first call of each launch waits out the
    # peer's late launch (50 and 30 us more), the others its slower half (5 and 0 us more)
    events = [x("_exchange_kernel", 0, 60, 1), x("_gemm_kernel", 60, 100, 1), x("_exchange_kernel", 160, 15, 1),
              x("_exchange_kernel", 1000, 40, 2), x("_gemm_kernel", 1040, 100, 2), x("_exchange_kernel", 1140, 10, 2)]
    text = report(events, 5)
    assert ("transfer (each of 4 calls as long as the fastest, 10.0 us): 0.040 ms = 12.3% of GPU busy; waiting for "
            "a peer: 0.080 ms at the first call of a launch (launch skew), 0.005 ms at the others") in text


def test_command_writes_the_report(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": _trace()}))
    out = tmp_path / "t.md"
    proc = subprocess.run([sys.executable, "-m", "bench.trace_gaps", str(trace), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().startswith("# GPU busy and idle — t.json") and "GPU busy" in proc.stdout
