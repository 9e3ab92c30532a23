"""bench/ptx_stats.py compiles a Triton kernel for sm_90 (or GB10's sm_121) on a machine without a GPU and counts what it waits on:
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


@triton.jit
def _matmul(a_ptr, b_ptr, c_ptr, K, BLOCK: tl.constexpr):
    """A K loop of loads that feed a dot: Triton pipelines them as asynchronous copies when it may vectorise."""
    i = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), tl.float32)
    for k in range(0, K, BLOCK):
        a = tl.load(a_ptr + i[:, None] * K + (k + i)[None, :])
        b = tl.load(b_ptr + (k + i)[:, None] * BLOCK + i[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + i[:, None] * BLOCK + i[None, :], acc)


def _counts(kernel: str, warps: int, *extra: str, signature: str = "x_ptr=*fp32,y_ptr=*fp32",
            constexprs: str = "BLOCK=1024", arch: int = 90) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "bench.ptx_stats", f"tests.bench.test_ptx_stats:{kernel}",
                          "--signature", signature, "--constexprs", constexprs, "--num-warps", str(warps),
                          "--arch", str(arch), *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"sm_{arch}, {warps} warps:" in out.stdout
    return {k: int(v) for k, v in re.findall(r"(\w+) (\d+)", out.stdout.split(":", 2)[-1])}


def test_a_reduction_across_warps_has_barriers_and_a_copy_none() -> None:
    copy, total = _counts("_copy", 4), _counts("_total", 4)
    assert copy["bar_sync"] == 0 and copy["shfl"] == 0
    assert total["bar_sync"] >= 1 and total["shfl"] >= 1 and total["shared_bytes"] > 0


def test_a_pipelined_loop_needs_the_alignment_the_runtime_gives() -> None:
    """Aligned pointers and a K that is a multiple of 16 (what the launcher specialises): the loop's loads become
    asynchronous copies feeding warpgroup MMAs; an unaligned pointer leaves them synchronous."""
    sig = dict(signature="a_ptr=*bf16,b_ptr=*bf16,c_ptr=*fp32,K=i32", constexprs="BLOCK=64")
    runtime = _counts("_matmul", 4, "--divisible", "K", **sig)
    assert runtime["cp_async"] > 0 and runtime["wgmma"] > 0 and runtime["spill_bytes"] == 0
    assert 0 < runtime["registers"] <= 255
    unaligned = _counts("_matmul", 4, "--divisible", "K", "--unaligned", "a_ptr,b_ptr", **sig)
    assert unaligned["cp_async"] == 0


def test_gb10_builds_with_the_blackwell_ptxas_and_has_no_warpgroup_mma() -> None:
    """sm_121 (GB10): Triton's CUDA 12.8 ptxas has no sm_12x, its ptxas-blackwell (12.9) has. GB10 has warp-level
    MMAs only: the same loop pipelines its loads and multiplies without wgmma."""
    sig = dict(signature="a_ptr=*bf16,b_ptr=*bf16,c_ptr=*fp32,K=i32", constexprs="BLOCK=64")
    gb10 = _counts("_matmul", 4, "--divisible", "K", arch=121, **sig)
    assert gb10["cp_async"] > 0 and gb10["wgmma"] == 0 and 0 < gb10["registers"] <= 255
