"""bench/served_profile.py's pieces that need no stack: where the profiled window sits, and the report written after
every step (so a run cut short keeps what it measured). A whole run starts a stack and profiles it (on the CPU
about a minute with make-tiny: `python -m bench.served_profile --model DIR --random-weights '' --device cpu ...`)."""

from __future__ import annotations

from bench.served_profile import markdown, profile_window


def test_the_window_skips_the_warm_up_and_one_batch_and_spans_two() -> None:
    # 3 warm-up batches of ~8 rounds: rounds 1..24; one measured batch more; then two batches' rounds.
    assert profile_window(3, 8) == (32, 16)


def test_the_report_renders_at_every_step_of_a_run() -> None:
    data = {"date": "2026-12-04T14:00:00", "model": "/tmp/wm-4", "recipe": "exl3:2.5+fp8", "concurrency": 8,
            "prompt_len": 128, "output_len": 8, "profiled_rounds": [33, 48], "batches": [],
            "profile_head": "not written yet"}
    assert "ready in ? s" in markdown(data)  # before the stack is up
    data["ready_s"] = 61.5
    data["batches"].append({"wall_s": 1.5, "ttft": {"median_ms": 950.0, "p99_ms": 1200.0},
                            "itl": {"median_ms": 3.1}, "errors": [],
                            "rank_stats": ["rank 0: rounds 33-40 in 1.5 s (5.3/s): ...; 1 kernel compiles (0.80 s)"]})
    md = markdown(data)
    assert "| 0 | 1.50 | 950 / 1200 | 3.10 |" in md
    assert "  - rank 0: rounds 33-40 in 1.5 s (5.3/s): ...; 1 kernel compiles (0.80 s)" in md
