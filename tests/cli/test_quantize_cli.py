"""Quantized checkpoints as a user makes them: make-tiny, quantize (fp8, w4a16) or make-tiny --format exl3, then
generate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TWINSPARK = str(Path(sys.executable).parent / "twinspark")


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([TWINSPARK, *args], capture_output=True, text=True, timeout=timeout, check=False)


def _generate(model: Path, *extra: str) -> list[int]:
    proc = _run("generate", "--model", str(model), "--prompt", "hello", "--json", "--max-tokens", "6", "--ignore-eos",
                *extra)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qcli") / "tiny"
    assert _run("make-tiny", "--out", str(out)).returncode == 0
    return out


@pytest.mark.parametrize("fmt, flags", [("fp8", ["--block-size", "8"]), ("w4a16", ["--block-size", "8"]),
                                        ("fp8", ["--per-channel", "--experts-only"])])
def test_quantize_then_generate(tiny_dir, tmp_path, fmt, flags):
    out = tmp_path / fmt
    proc = _run("quantize", "--model", str(tiny_dir), "--out", str(out), "--format", fmt, *flags)
    assert proc.returncode == 0, proc.stderr
    assert f"linears to {fmt}" in proc.stdout and "quantizing to" in proc.stderr  # the summary and the progress bar
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == {"fp8": "fp8", "w4a16": "twinspark_w4a16"}[fmt]
    assert (out / "tokenizer.json").exists() and (out / "model.safetensors.index.json").exists()
    assert len(_generate(out)) == 6


def test_make_tiny_exl3_then_generate(tmp_path):
    out = tmp_path / "exl3"
    proc = _run("make-tiny", "--out", str(out), "--format", "exl3", "--layers", "2", "--experts", "4")
    assert proc.returncode == 0, proc.stderr
    assert "EXL3 4 bits (mul1) MLPs" in proc.stdout
    assert len(_generate(out)) == 6


def test_a_split_off_the_block_grid_is_a_clear_error(tiny_dir, tmp_path):
    out = tmp_path / "fp8_16"
    assert _run("quantize", "--model", str(tiny_dir), "--out", str(out), "--format", "fp8",
                "--block-size", "16").returncode == 0
    proc = _run("generate", "--model", str(out), "--prompt", "hello")
    assert proc.returncode == 1 and "fp8 stores output rows in tiles of 16" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_options(tiny_dir, tmp_path):
    cases = [(["--format", "w4a16", "--block-size", "12"], "multiple of 8 for w4a16"),
             (["--format", "w4a16", "--per-channel"], "--per-channel is an fp8 option"),
             (["--format", "exl3", "--experts-only"], "not an exllamav3 option")]
    for flags, message in cases:
        proc = _run("quantize", "--model", str(tiny_dir), "--out", str(tmp_path / "x"), *flags)
        assert proc.returncode == 2 and message in proc.stderr, (flags, proc.stderr)
    same = _run("quantize", "--model", str(tiny_dir), "--out", str(tiny_dir), "--format", "fp8")
    assert same.returncode == 2 and "--out must differ from --model" in same.stderr
    missing = _run("quantize", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "y"), "--format", "fp8")
    assert missing.returncode == 2 and "no config.json" in missing.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the converter would run")
def test_exl3_without_a_cuda_gpu_says_what_it_needs(tiny_dir, tmp_path):
    proc = _run("quantize", "--model", str(tiny_dir), "--out", str(tmp_path / "e"), "--format", "exl3")
    assert proc.returncode == 2
    assert "needs a CUDA GPU and exllamav3" in proc.stderr and "missing here: a CUDA GPU" in proc.stderr
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("cmd", [["quantize"], ["make-tiny"]])
def test_help(cmd):
    proc = _run(*cmd, "--help")
    assert proc.returncode == 0 and "--format" in proc.stdout
