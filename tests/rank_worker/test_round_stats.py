"""The rank's per-window round stats (services/rank_worker/round_stats.py): what one line sums, when it is logged,
and (with stand-in timing events, no GPU here) the GPU per round and the gap between rounds."""

from __future__ import annotations

import logging

from services.rank_worker.round_stats import RoundStats


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeEvent:
    """A passed CUDA timing event at `ms` on the GPU's clock (a stand-in: no GPU on this machine)."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, other: "FakeEvent") -> float:
        return other.ms - self.ms


def test_a_window_sums_its_rounds_and_starts_a_new_one() -> None:
    clock = Clock()
    stats = RoundStats(0, interval_s=10.0, clock=clock)
    assert stats.line() is None  # no round: nothing to say
    stats.waited_for_plan(0.25)
    for r, (launch, behind) in enumerate([(1.0, False), (3.0, True), (2.0, True)], start=7):
        stats.launched(r, launch, behind)
        stats.finished(None, None, wait_ms=4.0)
    clock.t = 2.0
    line = stats.line()
    assert line is not None
    assert "rounds 7-9 in 2.0 s (1.5/s)" in line
    assert "host launch p50 2.00 ms (2 of 3 behind the previous round)" in line
    assert "read-back wait p50 4.00 ms" in line and "plan wait 0.25 s" in line
    assert "GPU" not in line  # CPU rounds carry no timing events
    assert "decode steps" not in line  # one-step rounds: nothing to say
    assert stats.line() is None  # the window was reset
    for r, steps in enumerate([4, 8, 1], start=10):  # rounds of several decode steps (StepPlan.steps)
        stats.launched(r, 1.0, True, steps=steps)
    clock.t = 4.0
    assert "(1.5/s, 4.3 decode steps per round)" in stats.line()


def test_gpu_per_round_and_the_gap_between_rounds_with_fake_events() -> None:
    stats = RoundStats(1, clock=Clock())
    # Round 1 runs 0..10 ms on the GPU; round 2 begins at 10 ms (queued in time: no gap), runs to 20; round 3 begins
    # 3 ms after round 2 ended (the GPU waited for the host) and runs 10 ms.
    for r, (begin, done) in enumerate([(0.0, 10.0), (10.0, 20.0), (23.0, 33.0)], start=1):
        stats.launched(r, 1.0, behind=r > 1)
        stats.finished(FakeEvent(begin), FakeEvent(done), wait_ms=9.0)
    line = stats.line()
    assert "GPU per round p50 10.00 ms" in line
    assert "GPU gap before a round p50 1.50 ms (3.0 ms in all)" in line  # gaps 0 and 3 ms


def test_logged_once_the_interval_has_passed(caplog) -> None:
    clock = Clock()
    stats = RoundStats(0, interval_s=10.0, clock=clock)
    stats.launched(1, 1.0, False)
    stats.finished(None, None, 1.0)
    with caplog.at_level(logging.INFO, logger="twinspark.rank"):
        clock.t = 9.0
        stats.maybe_log()
        assert not caplog.records
        clock.t = 10.0
        stats.maybe_log()
    assert [r.getMessage().startswith("rank 0: rounds 1-1 in 10.0 s") for r in caplog.records] == [True]


def test_rounds_with_prompt_rows_are_summed_apart() -> None:
    """A 700 ms prompt round among 10 ms decode rounds: the medians stay the decode rounds', and the prompt round
    shows in its own summary with its most."""
    stats = RoundStats(0, clock=Clock())
    spans = [(0.0, 10.0, False), (10.0, 710.0, True), (710.0, 720.0, False), (720.0, 730.0, False)]
    for r, (begin, done, prompt) in enumerate(spans, start=1):
        stats.launched(r, 900.0 if prompt else 2.0, behind=r > 1, prompt=prompt)
        stats.finished(FakeEvent(begin), FakeEvent(done), wait_ms=5.0, prompt=prompt)
    line = stats.line()
    assert "GPU per round p50 10.00 ms" in line and "host launch p50 2.00 ms" in line
    assert line.endswith("; 1 with prompt rows: GPU p50 700.00 / max 700.00 ms, host launch p50 900.00 / max "
                         "900.00 ms, read-back wait p50 5.00 / max 5.00 ms")
