"""How the benches time what they run, and the timestamped line they say it with.

- `time_calls`: a model step or a ceiling, one call at a time: CUDA events around each call on a GPU (synchronised
  after each), perf_counter on the CPU; milliseconds per call.
- `bench_ms` / `graph_ms`: one kernel's median per call, through Triton's do_bench (L2 flushed between calls), or
  replayed in a CUDA graph, which leaves out the host's launch time (it would swamp a one-row kernel, and the
  served decode path replays graphs too).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(step: Callable[[int], object], *, warmup: int, iters: int, device: torch.device) -> list[float]:
    """Milliseconds of `step(i)` for i = warmup .. warmup+iters-1 (after `warmup` untimed calls), one at a time."""
    for i in range(warmup):
        step(i)
    sync(device)
    times = []
    for i in range(warmup, warmup + iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step(i)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def bench_ms(fn: Callable[[], object], reps: int = 50) -> float:
    """Median milliseconds of one call (triton.testing.do_bench)."""
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=5, rep=reps, return_mode="median"))


def graph_ms(calls: list[Callable[[], object]]) -> float:
    """Median milliseconds per call of a CUDA graph replaying the calls in turn."""
    from triton.testing import do_bench_cudagraph
    turn = iter(range(1 << 62))
    return float(do_bench_cudagraph(lambda: calls[next(turn) % len(calls)](), rep=50, return_mode="median"))
