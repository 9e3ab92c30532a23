"""The rank's round profiler (TWINSPARK_TORCH_PROFILER_DIR): a window of rounds after a warm-up skip, written as
operator tables with the wall-time split, and a Chrome trace."""

from __future__ import annotations

import torch

from services.rank_worker.round_profiler import RoundProfiler


def test_window_after_skip_writes_tables_and_trace(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TWINSPARK_TORCH_PROFILER_DIR", str(tmp_path))
    monkeypatch.setenv("TWINSPARK_PROFILE_ROUNDS", "2:3")
    prof = RoundProfiler.from_env(rank=1)
    assert prof is not None
    x = torch.randn(64, 64)
    for r in range(1, 5):
        prof.before(r)
        x = torch.tanh(x @ x)
        prof.launched(r)
        prof.after(r)
    assert not (tmp_path / "rank1-rounds.txt").exists()  # the window (rounds 3..5) is still open
    prof.before(5)
    torch.tanh(x @ x)
    prof.launched(5)
    prof.after(5)
    text = (tmp_path / "rank1-rounds.txt").read_text()
    assert text.startswith("rank 1, rounds 3..5 (3):") and "launching (host)" in text
    assert "aten::mm" in text and "aten::tanh" in text
    assert (tmp_path / "rank1-rounds.json").stat().st_size > 0


def _squares(n: int) -> int:
    return sum(i * i for i in range(n))


def test_python_kind_writes_function_tables(tmp_path, monkeypatch) -> None:
    """TWINSPARK_PROFILE_KIND=python: cProfile over the window, the Python functions by own and cumulative time."""
    monkeypatch.setenv("TWINSPARK_TORCH_PROFILER_DIR", str(tmp_path))
    monkeypatch.setenv("TWINSPARK_PROFILE_ROUNDS", "1:2")
    monkeypatch.setenv("TWINSPARK_PROFILE_KIND", "python")
    prof = RoundProfiler.from_env(rank=0)
    assert prof is not None
    for r in range(1, 4):
        prof.before(r)
        _squares(20_000)
        prof.launched(r)
        prof.after(r)
    text = (tmp_path / "rank0-rounds.txt").read_text()
    assert text.startswith("rank 0, rounds 2..3 (2):")
    assert "# Python functions by own time" in text and "# Python functions by cumulative time" in text
    assert "_squares" in text
    assert not (tmp_path / "rank0-rounds.json").exists()  # no Chrome trace from cProfile


def test_off_without_the_directory_and_on_a_bad_window(monkeypatch) -> None:
    monkeypatch.delenv("TWINSPARK_TORCH_PROFILER_DIR", raising=False)
    assert RoundProfiler.from_env(0) is None
    monkeypatch.setenv("TWINSPARK_TORCH_PROFILER_DIR", "/tmp/x")
    monkeypatch.setenv("TWINSPARK_PROFILE_ROUNDS", "ten")
    assert RoundProfiler.from_env(0) is None
    monkeypatch.setenv("TWINSPARK_PROFILE_ROUNDS", "1:2")
    monkeypatch.setenv("TWINSPARK_PROFILE_KIND", "perf")
    assert RoundProfiler.from_env(0) is None
