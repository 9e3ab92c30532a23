"""How many decode steps a round runs (StepPlan.steps; vLLM's --num-scheduler-steps).

A round's host work — this loop's commit and plan, the gRPC hop, the rank's plan checks and launches, the answer —
is paid once per round, whatever its steps. When a model's decode step is short (a small model, or a few layers on
a fast GPU) that host work, not the GPU, sets the pace: on the wide tiny model the rank alone spent more host time
per round than GPU time, and the stream ran well behind the offline step (docs/benchmarks.md, "Batch-1 stream
against the offline step"). A round of k steps pays it once per k tokens.

The price of k: a stream's tokens arrive k at a time, and a request that comes in waits for the rounds in flight.
So `auto` takes as many steps as fit in AUTO_ROUND_MS of measured decode time, at most AUTO_MAX_STEPS: one step
whenever a step is that long already (the whole model's is), several only where the host is the short side.
The measure is the time between two rounds' results while the ranks had the second one queued all along (the
pipeline full), per step, averaged over recent rounds; it starts at one step.

Steps never change a reply: each step is the forward and keyed draw that a one-step round of the same rows runs.
"""

from __future__ import annotations

AUTO_ROUND_MS = 8.0
AUTO_MAX_STEPS = 8
_WEIGHT = 0.3  # of the newest round in the running average


class DecodeSteps:
    def __init__(self, setting: int) -> None:
        """setting: --num-scheduler-steps, 0 = auto."""
        self.setting = setting
        self.step_ms: float | None = None  # measured time per decode step, running average

    def want(self) -> int:
        """Steps for the next round of plain decode rows (the scheduler cuts it to what the requests may take)."""
        if self.setting:
            return self.setting
        if self.step_ms is None:
            return 1
        return max(1, min(AUTO_MAX_STEPS, int(AUTO_ROUND_MS // max(self.step_ms, 1e-3))))

    def observe(self, steps: int, seconds: float) -> None:
        """A round of decode rows and `steps` steps came back `seconds` after the round before it, having been
        queued on the ranks before that one came back."""
        ms = seconds * 1e3 / steps
        self.step_ms = ms if self.step_ms is None else (1 - _WEIGHT) * self.step_ms + _WEIGHT * ms
