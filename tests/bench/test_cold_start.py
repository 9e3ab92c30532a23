"""bench/cold_start.py's request mix: the second pass has the first's prompt lengths and none of its prompts (a
prefix-cache hit would pass for a warm kernel)."""

from __future__ import annotations

from bench.cold_start import MIX, bodies


def test_passes_share_lengths_not_prompts() -> None:
    first, second = bodies(1, 32), bodies(2, 32)
    assert [len(b["prompt"]) for b in first] == [len(b["prompt"]) for b in second] == list(MIX)
    assert all(a["prompt"][:16] != b["prompt"][:16] for a, b in zip(first, second))
    assert max(MIX) <= 1800 and len(MIX) == 12 and all(b["stream"] and b["ignore_eos"] for b in first)
