"""Where a serving rank's time goes, logged once per window (as vLLM logs its engine's throughput every few seconds).

A served decode step should cost what the offline step costs (docs/gpu-engine.md, "The rank's serving loop"): the
host queues round n+1 while the GPU runs round n. When the served inter-token time is longer, these figures say
which side is short:

- GPU per round: from a timing event recorded just before the round's work is queued to the event after its last
  copy to the host. Longer than the offline step means the GPU waited for the host inside the round (its kernels
  were queued more slowly than they ran).
- GPU gap before a round: from the previous round's last event to this round's first. Above zero means the GPU sat
  idle between rounds, waiting for the host to queue the next one.
- host launch: checking a plan and queueing its work (`Executor.launch`); behind = launched while the previous
  round was still in flight (the overlap working). Rounds of several decode steps (StepPlan.steps) say how many
  steps a round ran on average: their GPU time and launch cover every step.
- read-back wait: blocked in `Executor.finish` until the round's results were on the host.
- plan wait: blocked for the next plan with nothing in flight (the scheduler or the gRPC hop is the short side).
- kernel compiles: Triton compiles on the request path in the window (compile_watch.py), when there were any.
- rounds with prompt rows: a prompt chunk's round is rare and long next to decode rounds, so the medians above hide
  it; these rounds get their own count, GPU time, host launch and read-back wait (median and most), since a slow
  first token shows there.

Cheap enough to stay on: two events per round, a few list appends, one log line per window with rounds in it.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

log = logging.getLogger("twinspark.rank")

# Seconds between two lines: long enough that a line sums many decode rounds, short enough to see a run's phases.
DEFAULT_INTERVAL_S = 10.0


@dataclass
class _Kind:
    launch_ms: list[float] = field(default_factory=list)
    wait_ms: list[float] = field(default_factory=list)
    gpu_ms: list[float] = field(default_factory=list)

    def summary(self) -> str:
        gpu = f"GPU {_p50_max(self.gpu_ms)} ms, " if self.gpu_ms else ""
        return (f"{len(self.launch_ms)} with prompt rows: {gpu}host launch {_p50_max(self.launch_ms)} ms, "
                f"read-back wait {_p50_max(self.wait_ms)} ms")


@dataclass
class _Window:
    first_round: int = 0
    rounds: int = 0
    steps: int = 0  # decode steps of those rounds (StepPlan.steps; 1 for a one-step round)
    behind: int = 0
    launch_ms: list[float] = field(default_factory=list)
    wait_ms: list[float] = field(default_factory=list)
    gpu_ms: list[float] = field(default_factory=list)
    gap_ms: list[float] = field(default_factory=list)
    plan_wait_s: float = 0.0
    prompt: _Kind = field(default_factory=_Kind)  # the rounds with prompt rows, again apart


def _p50(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}" if xs else "-"


def _p50_max(xs: list[float]) -> str:
    return f"p50 {statistics.median(xs):.2f} / max {max(xs):.2f}" if xs else "-"


class RoundStats:
    def __init__(self, rank: int, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic,
                 compiles: Callable[[], tuple[int, float]] | None = None) -> None:
        """`compiles`: (count, seconds) of the kernel compiles since its last call (CompileWatch.take)."""
        self.rank = rank
        self._compiles = compiles
        self.interval_s = interval_s
        self._clock = clock
        self._start = clock()
        self._window = _Window()
        self._last_done: torch.cuda.Event | None = None  # the previous read-back round's last event

    def launched(self, round_: int, launch_ms: float, behind: bool, prompt: bool = False, steps: int = 1) -> None:
        """A round was queued in `launch_ms` of host time; `behind`: while the previous one was in flight;
        `prompt`: it has prompt rows; `steps`: its decode steps."""
        w = self._window
        if w.rounds == 0:
            w.first_round = round_
        w.rounds += 1
        w.steps += steps
        w.behind += behind
        w.launch_ms.append(launch_ms)
        if prompt:
            w.prompt.launch_ms.append(launch_ms)

    def finished(self, begin: torch.cuda.Event | None, done: torch.cuda.Event | None, wait_ms: float,
                 prompt: bool = False) -> None:
        """A round was read back after `wait_ms` blocked on it. `begin` / `done`: its timing events (None on the
        CPU, or for a plan of tier moves only), both passed by now; `prompt` as in `launched`."""
        w = self._window
        w.wait_ms.append(wait_ms)
        if prompt:
            w.prompt.wait_ms.append(wait_ms)
        if begin is None or done is None:
            return
        w.gpu_ms.append(begin.elapsed_time(done))
        if prompt:
            w.prompt.gpu_ms.append(w.gpu_ms[-1])
        if self._last_done is not None:  # rounds are read back in the order they ran on the one stream
            w.gap_ms.append(max(0.0, self._last_done.elapsed_time(begin)))
        self._last_done = done

    def waited_for_plan(self, seconds: float) -> None:
        """The loop blocked `seconds` for the next plan with no round in flight."""
        self._window.plan_wait_s += seconds

    def line(self) -> str | None:
        """The window's summary (None when no round ran in it), and a new window."""
        w, now = self._window, self._clock()
        span_s, self._start, self._window = now - self._start, now, _Window()
        built, built_s = self._compiles() if self._compiles is not None else (0, 0.0)
        if w.rounds == 0:
            return None
        gpu = (f"GPU per round p50 {_p50(w.gpu_ms)} ms, GPU gap before a round p50 {_p50(w.gap_ms)} ms "
               f"({sum(w.gap_ms):.1f} ms in all), ") if w.gpu_ms else ""
        steps = f", {w.steps / w.rounds:.1f} decode steps per round" if w.steps != w.rounds else ""
        return (f"rank {self.rank}: rounds {w.first_round}-{w.first_round + w.rounds - 1} in {span_s:.1f} s "
                f"({w.rounds / max(span_s, 1e-9):.1f}/s{steps}): {gpu}host launch p50 {_p50(w.launch_ms)} ms "
                f"({w.behind} of {w.rounds} behind the previous round), read-back wait p50 {_p50(w.wait_ms)} ms, "
                f"plan wait {w.plan_wait_s:.2f} s" + (f"; {w.prompt.summary()}" if w.prompt.launch_ms else "")
                + (f"; {built} kernel compiles ({built_s:.2f} s)" if built else ""))

    def maybe_log(self) -> None:
        """Log the window's line once `interval_s` has passed since the last (never with an interval of 0)."""
        if 0 < self.interval_s <= self._clock() - self._start:
            text = self.line()
            if text is not None:
                log.info(text)
