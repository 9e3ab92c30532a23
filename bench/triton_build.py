"""Compiling a Triton kernel for a GPU that is not here, with Triton's own compiler and ptxas, and counting what the
build waits on: barriers, warp shuffles, PTX size, asynchronous copies, warpgroup MMAs, shared memory, registers and
spills. bench.ptx_stats compiles one kernel named on its command line; bench.kernel_census every build the runtime
launches at the release's widths."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import tempfile
from collections.abc import Collection, Mapping

def stats(kernel, signature: dict[str, str], constexprs: dict[str, int | float | bool], *, num_warps: int = 4,
          num_stages: int = 3, arch: int = 90, divisible: Collection[str] = (), unaligned: Collection[str] = ()
          ) -> dict[str, int]:
    """Compile `kernel` (a @triton.jit function) for sm_<arch>, its pointers 16-byte aligned but `unaligned`, the
    `divisible` integers multiples of 16: counts of bar.sync, shfl.sync, PTX lines, cp.async and wgmma, its shared
    memory bytes, registers and spilled bytes per thread, and whether it waits for the kernel before it first
    (`waits_first`)."""
    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    hinted = [n for n, t in signature.items() if (t.startswith("*") and n not in unaligned) or n in divisible]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in hinted}
    return compiled_stats(kernel, sig, constexprs, attrs, num_warps=num_warps, num_stages=num_stages, arch=arch)


def compiled_stats(kernel, signature: dict[str, str], constexprs: Mapping, attrs: Mapping, *, num_warps: int,
                   num_stages: int, arch: int) -> dict[str, int]:
    """`stats` of one build given as Triton's JIT hands it to the compiler (signature with its constexprs marked,
    constexpr values and argument attributes by name or argument path), as bench/kernel_census.py records them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction
    if not isinstance(kernel, JITFunction):  # Triton's whole library is Python functions in that mode
        raise RuntimeError("kernels made under TRITON_INTERPRET cannot be compiled: run this in a process without it")
    src = triton.compiler.ASTSource(fn=kernel, signature=dict(signature), constexprs=dict(constexprs),
                                    attrs=dict(attrs))
    # Triton's own ptxas run prints its -v report when asked: read it there rather than assemble twice (a build
    # found in Triton's cache runs no ptxas, and is assembled again for the report).
    log, dump = io.StringIO(), triton.knobs.nvidia.dump_ptxas_log
    triton.knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": num_warps, "num_stages": num_stages})
    finally:
        triton.knobs.nvidia.dump_ptxas_log = dump
    ptx = compiled.asm["ptx"]
    return {"bar_sync": ptx.count("bar.sync"), "shfl": len(re.findall(r"\bshfl\.sync", ptx)),
            "ptx_lines": ptx.count("\n"), "cp_async": len(re.findall(r"\bcp\.async\.(?:ca|cg)", ptx)),
            "wgmma": len(re.findall(r"\bwgmma\.mma_async", ptx)), "shared_bytes": int(compiled.metadata.shared),
            "waits_first": waits_first(ptx),
            **_resources(log.getvalue() if "Used" in log.getvalue() else _assemble(ptx, arch))}


def waits_first(ptx: str) -> int:
    """1 when the build's first global memory access comes after its programmatic-launch wait
    (`griddepcontrol.wait`, kernels/gpu/pdl.py: nothing of an earlier kernel's may be read or overwritten before
    it), 0 when one comes before it, -1 when the build has no wait (launched without PDL)."""
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0:
        return -1
    access = re.search(r"\b(?:ld|st|atom|red)\.global\b|\bcp\.async\S*\.global\b", ptx)
    return int(access is None or access.start() > wait)


def ptxas_for(arch: int) -> str:
    """The ptxas Triton itself assembles sm_<arch> with. Its CUDA 12.8 `ptxas` knows no sm_12x (GB10 is sm_121), so
    from sm_100 on Triton takes the `ptxas-blackwell` it also bundles (CUDA 12.9); TRITON_PTXAS_PATH /
    TRITON_PTXAS_BLACKWELL_PATH override them, as they do for Triton."""
    from triton.backends.nvidia.compiler import get_ptxas
    return get_ptxas(arch).path


def _assemble(ptx: str, arch: int) -> str:
    """ptxas -v's report of `ptx`, from the ptxas Triton compiles `arch` with."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        arch_flag = f"-arch=sm_{arch}a" if arch >= 90 else f"-arch=sm_{arch}"
        return subprocess.run([ptxas_for(arch), "-v", arch_flag, f.name, "-o", os.devnull], capture_output=True,
                              text=True, check=True).stderr


def _resources(report: str) -> dict[str, int]:
    """Registers and spilled bytes per thread from a ptxas -v report."""
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return {"registers": int(regs.group(1)) if regs else -1, "spill_bytes": int(spills.group(1)) if spills else 0}
