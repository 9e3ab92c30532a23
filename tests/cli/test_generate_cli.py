"""The user's first commands, as a user types them: make-tiny, then generate at TP 1 and TP 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TWINSPARK = str(Path(sys.executable).parent / "twinspark")


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([TWINSPARK, *args], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "t"
    proc = _run("make-tiny", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.parametrize("cmd", [[], ["make-tiny"], ["generate"]])
def test_help(cmd):
    proc = _run(*cmd, "--help")
    assert proc.returncode == 0 and "usage:" in proc.stdout


@pytest.mark.tp
def test_generate_json_tp1_equals_tp2(tiny_dir):
    results = []
    for tp in ("1", "2"):
        proc = _run("generate", "--model", str(tiny_dir), "--prompt", "hello", "--json", "--max-tokens", "12",
                    "--tp", tp)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert isinstance(out["text"], str) and out["token_ids"] and all(isinstance(t, int) for t in out["token_ids"])
        results.append(out)
    assert results[0]["token_ids"] == results[1]["token_ids"]


def test_generate_ids_and_bad_ids(tiny_dir):
    ok = _run("generate", "--model", str(tiny_dir), "--ids", "1,2,3", "--json", "--max-tokens", "4", "--ignore-eos")
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout.strip().splitlines()[-1])["token_ids"]) == 4
    bad = _run("generate", "--model", str(tiny_dir), "--ids", "1,x", "--json")
    assert bad.returncode == 2 and "comma-separated" in bad.stderr
