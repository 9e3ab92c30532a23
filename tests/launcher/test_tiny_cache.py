"""The default tiny checkpoint: made once, reused, and never visible half-written."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from services.launcher import tiny_cache
from services.launcher.tiny_cache import MARKER, NAME, cache_root, ensure_tiny_default


def test_made_once_then_reused(tmp_path):
    calls = []

    def fake(out: Path):
        calls.append(out)
        (out / "config.json").write_text("{}")

    path, made = ensure_tiny_default(tmp_path, make=fake)
    assert made and path == tmp_path / NAME and (path / "config.json").is_file() and (path / MARKER).is_file()
    again, made2 = ensure_tiny_default(tmp_path, make=fake)
    assert again == path and not made2 and len(calls) == 1
    assert calls[0].parent == tmp_path and calls[0] != path  # built in a temp dir beside the target
    assert sorted(p.name for p in tmp_path.iterdir()) == [NAME]  # no temp dirs left


def test_failed_build_leaves_nothing(tmp_path):
    def broken(out: Path):
        (out / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ensure_tiny_default(tmp_path, make=broken)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_builds_one_wins_atomically(tmp_path):
    barrier = threading.Barrier(2)
    results, errors = [], []

    def slow(out: Path):
        (out / "config.json").write_text(json.dumps({"by": threading.get_ident()}))
        barrier.wait(timeout=5)  # both are mid-build before either renames

    def worker():
        try:
            results.append(ensure_tiny_default(tmp_path, make=slow))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not errors
    assert {p for p, _ in results} == {tmp_path / NAME} and sorted(m for _, m in results) == [False, True]
    assert sorted(p.name for p in tmp_path.iterdir()) == [NAME]
    assert (tmp_path / NAME / MARKER).is_file()


def test_foreign_dir_is_not_taken_for_a_checkpoint(tmp_path):
    (tmp_path / NAME).mkdir()
    with pytest.raises(RuntimeError, match="remove it"):
        ensure_tiny_default(tmp_path, make=lambda out: None)


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TWINSPARK_CACHE_DIR", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("TWINSPARK_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "x" / "twinspark"


def test_real_make_tiny(tmp_path):
    path, made = ensure_tiny_default(tmp_path)  # the real model.checkpoint.make_tiny
    assert made and json.loads((path / "config.json").read_text())
    assert (path / "tokenizer.json").is_file() and list(path.glob("*.safetensors"))
    assert ensure_tiny_default(tmp_path) == (path, False)
    assert tiny_cache.SEED == 0
