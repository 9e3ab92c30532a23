"""`twinspark eval` as a user meets it first: its help, and a one-line error (exit 1, no traceback) when the server
cannot be reached or the file is missing."""

from __future__ import annotations

import subprocess

from services.rank_worker.distributed import free_port
from tests.e2e.stack import TWINSPARK


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TWINSPARK, "eval", *args], capture_output=True, text=True, timeout=120)


def test_help_names_both_kinds_and_their_options():
    top = _run("--help")
    assert top.returncode == 0 and "ppl" in top.stdout and "kl" in top.stdout
    kl = _run("kl", "--help")
    assert kl.returncode == 0 and all(f in kl.stdout for f in ("--ref-url", "--top-k", "--window", "--out"))


def test_errors_are_one_line(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("some text to score")
    down = _run("ppl", "--url", f"http://127.0.0.1:{free_port()}", "--file", str(text), "--no-progress")
    assert down.returncode == 1 and "ConnectError" in down.stderr and "Traceback" not in down.stderr
    missing = _run("ppl", "--url", "http://127.0.0.1:1", "--file", str(tmp_path / "none.txt"))
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
