"""Quantized checkpoints as a user makes them: make-tiny, quantize (fp8, w4a16, int2 / int3 / int4, exl3:BITS) or
make-tiny --format exl3 / int3 / a recipe (int3:g32+fp8+fp8), then generate (the default flags end to end:
test_quantized_defaults.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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


METHOD = {"fp8": "fp8", "w4a16": "twinspark_w4a16", "int3": "twinspark_int", "int2": "twinspark_int"}


@pytest.mark.parametrize("fmt, flags", [("fp8", ["--per-channel", "--experts-only"]), ("w4a16", ["--block-size", "8"]),
                                        ("int3:g64", ["--experts-only"]), ("int2", ["--block-size", "16"])])
def test_quantize_then_generate(tiny_dir, tmp_path, fmt, flags):
    out = tmp_path / fmt
    proc = _run("quantize", "--model", str(tiny_dir), "--out", str(out), "--format", fmt, *flags)
    assert proc.returncode == 0, proc.stderr
    name = fmt.partition(":")[0]
    assert f"linears to {name}" in proc.stdout and "quantizing to" in proc.stderr  # the summary and the progress bar
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == METHOD[name]
    assert (out / "tokenizer.json").exists() and (out / "model.safetensors.index.json").exists()
    assert len(_generate(out)) == 6


def test_int_runs_twice_in_one_group_size(tiny_dir, tmp_path):
    experts = tmp_path / "int3"
    assert _run("quantize", "--model", str(tiny_dir), "--out", str(experts), "--format", "int3",
                "--experts-only").returncode == 0
    group = json.loads((experts / "config.json").read_text())["quantization_config"]["group_size"]
    both = tmp_path / "int3+int4"
    proc = _run("quantize", "--model", str(experts), "--out", str(both), "--format", "int4")
    assert proc.returncode == 0, proc.stderr
    assert f"groups of {group}: the group size of the int linears" in proc.stdout and "modules already" in proc.stdout
    config = json.loads((both / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["group_size"]) == ("twinspark_int", group) and len(_generate(both)) == 6
    other = 32 if group != 32 else 64
    bad = _run("quantize", "--model", str(experts), "--out", str(tmp_path / "x"), "--format", f"int4:g{other}")
    assert bad.returncode == 2 and f"stores its int linears in groups of {group}" in bad.stderr
    assert f"--block-size {group}" in bad.stderr and not (tmp_path / "x").exists()


@pytest.mark.parametrize("recipe, said", [("int3", "int3 linears in groups of 32"),
                                          ("int3:g32+fp8+fp8", "int3 linears in groups of 32, lm_head fp8")])
def test_make_tiny_int3_then_generate(tmp_path, recipe, said):
    out = tmp_path / "int3"
    proc = _run("make-tiny", "--out", str(out), "--format", recipe, "--layers", "2", "--experts", "4")
    assert proc.returncode == 0, proc.stderr
    assert said in proc.stdout
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 32
    assert len(_generate(out)) == 6


def test_make_tiny_exl3_then_generate(tmp_path):
    out = tmp_path / "exl3"
    proc = _run("make-tiny", "--out", str(out), "--format", "exl3", "--layers", "2", "--experts", "4")
    assert proc.returncode == 0, proc.stderr
    assert "EXL3 4 bits (mul1) MLPs" in proc.stdout
    assert len(_generate(out)) == 6


def test_make_tiny_exl3_at_a_bitrate(tmp_path):
    out = tmp_path / "exl3_25"
    proc = _run("make-tiny", "--out", str(out), "--format", "exl3:2.5", "--codebook", "mcg", "--layers", "2",
                "--experts", "2")
    assert proc.returncode == 0, proc.stderr
    assert "EXL3 2.5 bits (mcg) MLPs" in proc.stdout
    rates = {e["bits_per_weight"] for e in json.loads((out / "quantization_config.json").read_text())
             ["tensor_storage"].values()}
    assert rates == {2, 3}
    bad = _run("make-tiny", "--out", str(tmp_path / "bad"), "--format", "exl3:0.5")
    assert bad.returncode == 2 and "from 1 to 8" in bad.stderr and not (tmp_path / "bad").exists()


def test_a_split_off_the_block_grid_is_a_clear_error(tiny_dir, tmp_path):
    out = tmp_path / "fp8_16"  # planned for 1 virtual shard, loaded at the default 4
    assert _run("quantize", "--model", str(tiny_dir), "--out", str(out), "--format", "fp8",
                "--block-size", "16", "--virtual-shards", "1").returncode == 0
    proc = _run("generate", "--model", str(out), "--prompt", "hello")
    assert proc.returncode == 1 and "fp8 stores output rows in tiles of 16" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_options(tiny_dir, tmp_path):
    cases = [(["--format", "w4a16", "--block-size", "12"], "multiple of 8 for w4a16"),
             (["--format", "w4a16", "--per-channel"], "--per-channel is an fp8 option"),
             (["--format", "exl3:9"], "EXL3 bits per weight must be a number from 1 to 8"),
             (["--format", "exl3:3", "--bits", "2"], "disagree"),
             (["--format", "fp8:3"], "only exl3 takes a bitrate"),
             (["--format", "fp8", "--exllamav3"], "--exllamav3 runs exllamav3's converter"),
             (["--format", "exl3", "--exllamav3", "--experts-only"], "no --experts-only"),
             (["--format", "exl3:3.0"], "no linear fits exl3"),  # the default tiny model is 64 wide
             (["--format", "fp8", "--virtual-shards", "0"], "must be positive"),
             (["--format", "int3", "--block-size", "16"], "the group size times the bits must be a multiple of 32"),
             (["--format", "int3:g64", "--block-size", "32"], "disagree"),
             (["--format", "int3:64"], "group size as :gGROUP"),
             (["--format", "int3", "--bits", "3"], "--bits is EXL3's bits per weight"),
             (["--format", "int3+fp8+int4"], "HEAD int4: lm_head is kept bf16 or stored in fp8"),
             (["--format", "int3+fp8+fp8"], "lm_head [1088, 64] is not whole fp8 blocks of 32 x 32"),
             (["--format", "int3+fp8", "--experts-only"], "--experts-only takes one FORMAT"),
             (["--format", "bf16+bf16"], "quantizes nothing")]

    def quantize(i: int, flags: list[str]) -> subprocess.CompletedProcess:
        return _run("quantize", "--model", str(tiny_dir), "--out", str(tmp_path / f"x{i}"), *flags)

    # Each case is a process of its own that mostly imports: four at a time (a case a time took ~70 s of the suite)
    with ThreadPoolExecutor(max_workers=4) as pool:
        procs = list(pool.map(quantize, range(len(cases)), [flags for flags, _ in cases]))
    for i, ((flags, message), proc) in enumerate(zip(cases, procs)):
        assert proc.returncode == 2 and message in proc.stderr, (flags, proc.stderr)
        assert not (tmp_path / f"x{i}").exists(), flags
    same = _run("quantize", "--model", str(tiny_dir), "--out", str(tiny_dir), "--format", "fp8")
    assert same.returncode == 2 and "--out must differ from --model" in same.stderr
    missing = _run("quantize", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "y"), "--format", "fp8")
    assert missing.returncode == 2 and "no config.json" in missing.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the converter would run")
def test_exllamav3s_converter_without_a_cuda_gpu_says_what_it_needs(tiny_dir, tmp_path):
    proc = _run("quantize", "--model", str(tiny_dir), "--out", str(tmp_path / "e"), "--format", "exl3:3.0",
                "--exllamav3")
    assert proc.returncode == 2
    assert "needs a CUDA GPU and exllamav3" in proc.stderr and "missing here: a CUDA GPU" in proc.stderr
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("cmd", [["quantize"], ["make-tiny"], ["serve-rank"], ["up"]])
def test_help_gives_the_bitrate_and_group_syntax(cmd):
    proc = _run(*cmd, "--help")
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and "exl3:3.0" in text and "int3" in text and ":gGROUP" in text, proc.stdout
    assert "[+HEAD]" in text and "+fp8+fp8" in text, proc.stdout  # the recipe's lm_head term
