"""bench/ptx_stats.py compiles a Triton kernel for sm_90 on a machine without a GPU and counts what it waits on:
a reduction across a program's warps shows as barriers, an elementwise kernel has none. (In a process of its own:
the suite runs Triton in interpreter mode, whose kernels cannot be compiled.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[2]


@triton.jit
def _copy(x_ptr, y_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i) * 2.0)


@triton.jit
def _total(x_ptr, y_ptr, BLOCK: tl.constexpr):
    tl.store(y_ptr, tl.sum(tl.load(x_ptr + tl.arange(0, BLOCK)), axis=0))


def _counts(kernel: str, warps: int) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "bench.ptx_stats", f"tests.bench.test_ptx_stats:{kernel}",
                          "--signature", "x_ptr=*fp32,y_ptr=*fp32", "--constexprs", "BLOCK=1024",
                          "--num-warps", str(warps)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"sm_90, {warps} warps:" in out.stdout
    return {k: int(v) for k, v in re.findall(r"(\w+) (\d+)", out.stdout.split(":", 2)[-1])}


def test_a_reduction_across_warps_has_barriers_and_a_copy_none() -> None:
    copy, total = _counts("_copy", 4), _counts("_total", 4)
    assert copy["bar_sync"] == 0 and copy["shfl"] == 0
    assert total["bar_sync"] >= 1 and total["shfl"] >= 1 and total["shared_bytes"] > 0
