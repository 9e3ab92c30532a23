"""torch.profiler over a window of served rounds on a rank (vLLM's VLLM_TORCH_PROFILER_DIR for the rank worker).

    TWINSPARK_TORCH_PROFILER_DIR=/tmp/prof TWINSPARK_PROFILE_ROUNDS=200:50 twinspark up --device cuda ...

profiles rounds 201..250 of each rank's step stream (skip 200 for warm-up and graph captures) and writes
rank<R>-rounds.txt: where the window's wall time went (the host's time launching rounds — checks, queueing kernels —
vs the rest: waiting for the GPU, reading back, the gRPC hop, the scheduler, waiting for the next plan), then
torch's operator tables sorted by GPU and by CPU time; and
rank<R>-rounds.json, a Chrome trace (chrome://tracing, Perfetto). Off unless the directory is set.

With TWINSPARK_PROFILE_KIND=python the window is profiled by cProfile instead, on the thread that launches and
reads back the rounds: the tables are then Python functions by own and by cumulative time (where the host's time
per round goes when the host, not the GPU, is the short side: checks, row tables, small copies, sampling's calls).
cProfile slows the Python it watches, so its wall times are above the unprofiled ones; the shares are what it says.
"""

from __future__ import annotations

import cProfile
import io
import logging
import os
import pstats
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)


KINDS = ("torch", "python")


class RoundProfiler:
    def __init__(self, out_dir: Path, rank: int, skip: int, count: int, kind: str = "torch") -> None:
        self.out_dir = out_dir
        self.rank = rank
        self.first = skip + 1
        self.last = skip + count
        self.kind = kind
        self._prof: torch.profiler.profile | cProfile.Profile | None = None
        self._t0 = 0.0
        self._exec_s = 0.0
        self._started = 0.0

    @classmethod
    def from_env(cls, rank: int) -> RoundProfiler | None:
        out = os.environ.get("TWINSPARK_TORCH_PROFILER_DIR")
        if not out:
            return None
        skip, _, count = os.environ.get("TWINSPARK_PROFILE_ROUNDS", "200:50").partition(":")
        kind = os.environ.get("TWINSPARK_PROFILE_KIND", "torch")
        if kind not in KINDS:
            log.error("TWINSPARK_PROFILE_KIND must be one of %s, got %r: not profiling", ", ".join(KINDS), kind)
            return None
        try:
            return cls(Path(out), rank, int(skip), int(count or 50), kind)
        except ValueError:
            log.error("TWINSPARK_PROFILE_ROUNDS must be SKIP:COUNT, got %r: not profiling",
                      os.environ["TWINSPARK_PROFILE_ROUNDS"])
            return None

    def before(self, round_no: int) -> None:
        if round_no == self.first:
            if self.kind == "python":
                self._prof = cProfile.Profile()
                self._prof.enable()
            else:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self._prof = torch.profiler.profile(activities=activities)
                self._prof.__enter__()
            self._t0 = time.perf_counter()
            log.info("rank %d: profiling rounds %d..%d (%s)", self.rank, self.first, self.last, self.kind)
        self._started = time.perf_counter()

    def launched(self, round_no: int) -> None:
        """The round's work is queued (Executor.launch returned)."""
        if self._prof is not None:
            self._exec_s += time.perf_counter() - self._started

    def after(self, round_no: int) -> None:
        """The round has been read back and answered."""
        if self._prof is None:
            return
        if round_no < self.last:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        prof, self._prof = self._prof, None
        n = self.last - self.first + 1
        head = (f"rank {self.rank}, rounds {self.first}..{self.last} ({n}): {wall * 1e3:.1f} ms wall = "
                f"{wall * 1e3 / n:.2f} ms per round; launching (host) {self._exec_s * 1e3 / n:.2f} ms per round, "
                f"the rest {(wall - self._exec_s) * 1e3 / n:.2f} ms per round\n")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"rank{self.rank}-rounds.txt"
        if isinstance(prof, cProfile.Profile):
            prof.disable()
            text = head
            for order, title in (("tottime", "own"), ("cumulative", "cumulative")):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(40)
                text += f"\n# Python functions by {title} time\n" + buf.getvalue()
            path.write_text(text)
        else:
            prof.__exit__(None, None, None)
            avg = prof.key_averages()
            sort_gpu = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
            path.write_text(head + "\n# by GPU time\n" + avg.table(sort_by=sort_gpu, row_limit=40)
                            + "\n# by CPU time (self)\n" + avg.table(sort_by="self_cpu_time_total", row_limit=40))
            prof.export_chrome_trace(str(self.out_dir / f"rank{self.rank}-rounds.json"))
        log.info("rank %d: %s (profile in %s)", self.rank, head.strip(), path)
