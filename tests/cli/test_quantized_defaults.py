"""The quantized defaults fit together, as a user types the commands: make-tiny, then `quantize --format fp8 |
w4a16 | int4 | int3 | int2 | exl3:3.0` (or the recipe int4+fp8+fp8: lm_head in fp8 too) with no other flag, then
`generate` with default flags — the same token ids at TP 1, 2 and 4.

quantize plans for the rank worker's 4 virtual shards: every packed linear is whole tiles on each shard, with the
fp8 block / w4a16 or int group chosen from that plan (8 for the 64-wide tiny model; int3 and int2 only try groups
that are whole 32-bit words, and take 32 and 16) and said in the output. EXL3's tile is
128 x 128, wider than anything in the default tiny model, so its run starts from `make-tiny --preset exl3` (MLPs 512
wide), the dense twin of what `make-tiny --format exl3` writes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.tp  # several rank processes over gloo

TWINSPARK = str(Path(sys.executable).parent / "twinspark")


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([TWINSPARK, *args], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("defaults")
    dirs = {"tiny": root / "tiny", "wide": root / "wide"}
    for d, flags in ((dirs["tiny"], []), (dirs["wide"], ["--preset", "exl3", "--layers", "2", "--experts", "2"])):
        proc = _run("make-tiny", "--out", str(d), *flags)
        assert proc.returncode == 0, proc.stderr
    return dirs


@pytest.mark.parametrize("fmt, src, plan_line", [
    ("fp8", "tiny", "block size 8, from that plan"),
    ("w4a16", "tiny", "block size 8, from that plan"),
    ("int4", "tiny", "block size 8, from that plan"),
    ("int4+fp8+fp8", "tiny", "block size 8, from that plan"),  # a recipe in one run, lm_head in fp8 too
    ("int3", "tiny", "block size 32, from that plan: the largest of 128/64/32 that leaves no linear dense that 32"),
    ("int2", "tiny", "block size 16, from that plan: the largest of 128/64/32/16 "),
    ("exl3:3.0", "wide", "EXL3 at 3 bits per weight (mul1): 22 linears at 3: 3.00 bits per weight on average")])
def test_quantize_then_generate_with_default_flags_at_tp_1_2_4(made, tmp_path, fmt, src, plan_line):
    out = tmp_path / "q"
    proc = _run("quantize", "--model", str(made[src]), "--out", str(out), "--format", fmt)
    assert proc.returncode == 0, proc.stderr
    assert "planned for 4 virtual shards" in proc.stdout and "loads at TP 1, 2, 4" in proc.stdout
    assert plan_line in proc.stdout
    method = json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"]
    assert method == {"fp8": "fp8", "w4a16": "twinspark_w4a16", "exl3:3.0": "exl3"}.get(fmt, "twinspark_int")
    stored = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("lm_head.weight_scale_inv" in stored) == fmt.endswith("+fp8+fp8")  # lm_head stays bf16 unless HEAD is fp8
    ids = []
    for tp in ("1", "2", "4"):
        gen = _run("generate", "--model", str(out), "--prompt", "hello", "--json", "--tp", tp)
        assert gen.returncode == 0, gen.stderr
        ids.append(json.loads(gen.stdout.strip().splitlines()[-1])["token_ids"])
    assert ids[0] and ids[0] == ids[1] == ids[2]
