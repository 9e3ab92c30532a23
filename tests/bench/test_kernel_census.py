"""The kernel census (bench/kernel_census.py) in CI: every Triton build the fused forward launches at the release's
widths, compiled for Hopper (sm_90) and GB10 (sm_121) with Triton's own compiler, within each architecture's shared
memory a block; and the per-architecture tables really reach the builds (kernels/gpu/arch.py).

CI runs four recipes at one width (bf16, fp8, EXL3 4-bit experts with a W4A16 rest, int3 experts with an int8
rest: every weight format the kernels read, at TP 1 with 4 virtual shards, bf16 and fp8 KV rows); the other
recipes and widths (`python -m bench.kernel_census`, ~4 minutes here) add no format, only other K splits and
EXL3 rates. In a process of its own: the suite runs Triton's interpreter, whose kernels cannot be compiled."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPES = "bf16,fp8,exl3:4.0+w4a16,int3+int8"
# Triton kernels the census does not launch, and why (docs/gpu-engine.md, "Kernel census").
NOT_IN_CENSUS = {"model.device_exchange._exchange_kernel": "the same-host CUDA IPC collective: a copy loop"}


@pytest.fixture(scope="module")
def census(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("census") / "census.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "bench.kernel_census", "--recipes", RECIPES, "--shardings", "1x4",
                          "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.exists(), run.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_build_fits_its_architecture(census) -> None:
    over = [f"sm_{r['arch']} {r['kernel']} [{r['label']}]: {r['shared_bytes']} bytes" for r in census if not r["fits"]]
    assert not over, "over the shared memory a block: " + "; ".join(over)


def test_every_triton_kernel_is_in_the_census(census) -> None:
    defined = set()
    for path in [*(REPO / "kernels" / "gpu").glob("*.py"), REPO / "model" / "device_exchange.py"]:
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        defined |= {f"{module}.{name}" for name in re.findall(r"@triton\.jit[^\n]*\ndef (\w+_kernel)\(",
                                                               path.read_text())}
    for arch in (90, 121):
        seen = {r["kernel"] for r in census if r["arch"] == arch}
        assert defined - seen == set(NOT_IN_CENSUS), defined - seen


def test_gb10_builds_take_their_table_row(census) -> None:
    """The rows of kernels/gpu/arch.py's tables reach the builds: the GEMM's decode tile at 3 stages and its
    prompt tile 128 wide on sm_121 (4 and 256 on sm_90), the MLA prompt tile at 16 heads, the expanded form at
    one stage; no Triton build on sm_121 uses warpgroup MMAs (GB10 has none)."""
    def picks(arch: int, kernel: str, **where) -> set:
        return {(r["label"].split("; ")[1]) for r in census if r["arch"] == arch and r["kernel"].endswith(kernel)
                and all(r["constexprs"].get(k) == v for k, v in where.items())}
    assert picks(90, "_gemm_kernel", BLOCK_M=16) == {"4 warps, 4 stages"}
    assert picks(121, "_gemm_kernel", BLOCK_M=16) == {"4 warps, 3 stages"}
    assert {r["constexprs"]["BLOCK_N"] for r in census if r["arch"] == 121 and r["kernel"].endswith("_gemm_kernel")
            and r["constexprs"]["BLOCK_M"] == 128} == {128}
    assert picks(121, "mla._attention_kernel", PARTIAL=False) == {"4 warps, 2 stages"}
    assert {r["constexprs"]["HB"] for r in census if r["arch"] == 121 and r["kernel"].endswith("._attention_kernel")
            } == {16}
    assert picks(121, "_expanded_kernel") == {"8 warps, 1 stages"}
    assert all(r["wgmma"] == 0 for r in census if r["arch"] == 121)


def test_every_build_waits_for_the_kernel_before_it_first(census) -> None:
    """Programmatic dependent launch (kernels/gpu/pdl.py): every build, as compiled for a GPU, waits for the kernel
    before it on the stream before its first global load or store, so no earlier kernel's output is read early and
    nothing it still reads is overwritten."""
    early = [f"sm_{r['arch']} {r['kernel']} [{r['label']}]" for r in census if r["waits_first"] != 1]
    assert not early, "memory touched before the wait, or no wait: " + "; ".join(early)
