"""The percentiles every bench reports, computed one way: nearest rank over the sorted values (no interpolation, so
a p99 is a latency that some request really had)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def percentile(xs: Sequence[float], q: float) -> float:
    """The value at quantile `q` (0..1) of `xs` (not empty), nearest rank."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def ms_summary(seconds: Sequence[float]) -> dict[str, float]:
    """Mean, median and p99 of durations in seconds, as milliseconds ({} for none)."""
    if not seconds:
        return {}
    return {"mean_ms": statistics.fmean(seconds) * 1e3, "median_ms": statistics.median(seconds) * 1e3,
            "p99_ms": percentile(seconds, 0.99) * 1e3}
