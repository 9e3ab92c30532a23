"""bench/decode_prefill.py's host profile of a step (written beside the kernel sequence with --profile on a GPU)."""

from __future__ import annotations

from pathlib import Path

from bench.decode_prefill import profile_host


def _plan_rows(n: int) -> list[int]:
    return [i * i % 7 for i in range(n)]


def test_host_profile_names_the_python_work(tmp_path: Path) -> None:
    out = tmp_path / "host.txt"
    profile_host(lambda: _plan_rows(50_000), out)
    text = out.read_text()
    assert "_plan_rows" in text and "Ordered by: internal time" in text and "Ordered by: cumulative time" in text
