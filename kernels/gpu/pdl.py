"""Programmatic dependent launch (PDL): each Triton kernel's programs are placed on the GPU while the kernel before
it on the stream is still finishing, and wait there for its results.

A decode step is about a hundred launches, most of them a few microseconds long (docs/gpu-engine.md, "Launches
per decode step"). Even inside a CUDA graph a kernel's programs are only placed once the last program of the kernel
before it has exited, and then ramp up (index arithmetic, the first loads): a microsecond or two a launch in which
the memory idles. Hopper and later (sm_90+) let a launch marked `launch_pdl` start as soon as every program of the
kernel before it has called `griddepcontrol.launch_dependents`; its own programs then block in `griddepcontrol.wait`
until that kernel has finished and its writes are visible. CUDA graphs keep the relation when a stream is captured.

The one rule every kernel of kernels/gpu keeps, so that a step computes exactly what serial launches compute:
`wait_for_inputs(PDL)` is its first statement, before any load or store. A kernel reads what earlier kernels wrote
and may overwrite what they still read; the wait covers both. It signals its own dependents only after that wait,
so a launch never runs more than one kernel ahead, and each wait covers every kernel before it on the stream (the
one it waits for had itself waited for its predecessor). Kernels of other libraries (humming-kernels, torch's own)
never signal: a kernel after one of them starts as it always did. tests/kernels/test_pdl.py checks the rule in the
source of every launched kernel.

`TWINSPARK_PDL=0`, set before the process starts, turns it off (the launches are then plain ones: bench.decode_prefill
run with and without it compares the two).

What a kernel may do before its wait: index arithmetic, and `prefetch_l2` of data no kernel of the step writes (its
weights). A prefetch is a hint to the memory system and returns nothing to the program, so no value can depend on
it; it lets a product's first weight lines stream into L2 while the kernel before it (often a few microseconds of
small, latency-bound work) still runs. `TWINSPARK_PREFETCH_MIB` bounds the bytes one launch prefetches (default
`PREFETCH_MIB`; 0 = none); nothing is prefetched without PDL, where no program runs before the previous kernel ends.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels.gpu import INTERPRET, arch as gpu_arch

ENV = "TWINSPARK_PDL"
MIN_CAPABILITY = 90  # griddepcontrol: sm_90 (Hopper) and later
PREFETCH_ENV = "TWINSPARK_PREFETCH_MIB"
# The best of 0 / 16 / 64 / 256 MiB on the 4-layer slice (docs/benchmarks.md, "Prefetch before the wait"). More than
# the 50 MB L2 is fine: each program prefetches only the first lines of its own slice, which it reads first.
PREFETCH_MIB = 64
LINE_BYTES = 128  # the L2 line a prefetch fills


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """The first statement of every kernel: with PDL, wait until the kernel before this one has finished (its
    writes visible), then let the next one be placed."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@lru_cache(maxsize=None)
def enabled() -> bool:
    """Whether launches use PDL: not under Triton's interpreter, not with TWINSPARK_PDL=0, and only on sm_90+.
    Decided once, at the process's first launch (a rank drives one GPU): `options()` runs before every launch of an
    eager round, so it reads no environment and asks no driver."""
    if INTERPRET or os.environ.get(ENV, "1") == "0" or not torch.cuda.is_available():
        return False
    return gpu_arch.facts(torch.cuda.current_device()).capability >= MIN_CAPABILITY


@lru_cache(maxsize=None)
def _prefetch_budget() -> int:
    return int(float(os.environ.get(PREFETCH_ENV, PREFETCH_MIB)) * 2**20)


def prefetch_bytes() -> int:
    """Bytes one launch may prefetch into L2 before its wait: 0 without PDL or with TWINSPARK_PREFETCH_MIB=0 (read
    once per process, as `enabled`)."""
    return _prefetch_budget() if enabled() else 0


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines holding `ptrs` (any shape of pointers; every address inside its tensor). Inline PTX
    because Triton's language has no prefetch; `is_pure=False` keeps the unused result from being dropped."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


_ON = {"PDL": True, "launch_pdl": True}


def options() -> dict[str, bool]:
    """The keyword arguments of a kernel launch: the kernel's PDL switch and Triton's `launch_pdl` launch option
    when `enabled()`, nothing otherwise (the kernels' PDL defaults to off)."""
    return _ON if enabled() else {}
