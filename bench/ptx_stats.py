"""What a Triton kernel compiles to for a GPU that is not here: barriers, warp shuffles, PTX size, shared memory.

    python -m bench.ptx_stats kernels.gpu.mhc:_pre_row_kernel --num-warps 16 \\
        --signature s_ptr=*bf16,ws_ptr=*fp32,base_ptr=*fp32,scale_ptr=*fp32,nw_ptr=*bf16,h_ptr=*bf16,\\
post_ptr=*fp32,comb_ptr=*fp32,D=i32,hc_eps=fp32,norm_eps=fp32,rms_eps=fp32 \\
        --constexprs CHUNKS=64,CHUNKS_P2=64,ITERS=20,HC=4,BLOCK_D=4096
    -> kernels.gpu.mhc:_pre_row_kernel sm_90, 16 warps: bar_sync 80, shfl 116, ptx_lines 2714, cp_async 0, wgmma 0,
       shared_bytes 8192, registers 90, spill_bytes 0

compiles the kernel with Triton's own compiler and ptxas for sm_90 (default) on any machine, no GPU needed, and
prints the counts. Why: a decode step's small kernels are latency-bound, and what they wait on shows in the code
before any timing — a reduction across a program's warps costs a `bar.sync` and a round trip through shared memory
(the mHC decode kernel's Sinkhorn iterations were 57 of its 78 barriers). Device time is short; this narrows what
to time.

It compiles what the runtime would: pointer arguments 16-byte aligned, as torch allocates them (unless named in
`--unaligned`, for those a kernel marks `do_not_specialize_on_alignment`), and the integers named in `--divisible`
multiples of 16, as the launcher specialises them. Without those hints Triton can neither vectorise a load nor
turn a loop's loads into asynchronous copies, and the counts would describe a kernel that never runs. Besides the
counts above: registers and spilled bytes per thread (ptxas -v), asynchronous copies (cp.async: a loop whose loads
are pipelined) and warpgroup MMAs (wgmma) in the PTX.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Collection, Mapping
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _pairs(text: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{item!r} is not NAME=VALUE")
        out[key] = value
    return out


def _constexpr(value: str) -> int | float | bool:
    if value in ("True", "False"):
        return value == "True"
    try:
        return int(value)
    except ValueError:
        return float(value)


def stats(kernel, signature: dict[str, str], constexprs: dict[str, int | float | bool], *, num_warps: int = 4,
          num_stages: int = 3, arch: int = 90, divisible: Collection[str] = (), unaligned: Collection[str] = ()
          ) -> dict[str, int]:
    """Compile `kernel` (a @triton.jit function) for sm_<arch>, its pointers 16-byte aligned but `unaligned`, the
    `divisible` integers multiples of 16: counts of bar.sync, shfl.sync, PTX lines, cp.async and wgmma, its shared
    memory bytes, registers and spilled bytes per thread."""
    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    hinted = [n for n, t in signature.items() if (t.startswith("*") and n not in unaligned) or n in divisible]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in hinted}
    return compiled_stats(kernel, sig, constexprs, attrs, num_warps=num_warps, num_stages=num_stages, arch=arch)


def compiled_stats(kernel, signature: dict[str, str], constexprs: Mapping, attrs: Mapping, *, num_warps: int,
                   num_stages: int, arch: int) -> dict[str, int]:
    """`stats` of one build given as Triton's JIT hands it to the compiler (signature with its constexprs marked,
    constexpr values and argument attributes by name or argument path): bench/kernel_census.py records them so."""
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
            **_resources(log.getvalue() if "Used" in log.getvalue() else _assemble(ptx, arch))}


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ptx_stats", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", help="module:name of a @triton.jit function, e.g. kernels.gpu.mhc:_pre_row_kernel")
    ap.add_argument("--signature", type=_pairs, required=True,
                    help="its runtime arguments' types, NAME=TYPE,... (*fp32, *bf16, i32, fp32, ...)")
    ap.add_argument("--constexprs", type=_pairs, default={}, help="its constexpr arguments, NAME=VALUE,...")
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--num-stages", type=int, default=3, help="software pipeline stages (Triton's default: 3)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: Hopper; 121: GB10, "
                    "assembled by the ptxas-blackwell Triton bundles)")
    ap.add_argument("--divisible", default="", help="integer arguments that are multiples of 16 (strides, sizes), "
                    "comma-separated: the launcher specialises them so")
    ap.add_argument("--unaligned", default="", help="pointer arguments not assumed 16-byte aligned "
                    "(a kernel's do_not_specialize_on_alignment), comma-separated")
    args = ap.parse_args(argv)
    module, _, name = args.kernel.partition(":")
    kernel = getattr(importlib.import_module(module), name)
    got = stats(kernel, args.signature, {k: _constexpr(v) for k, v in args.constexprs.items()},
                num_warps=args.num_warps, num_stages=args.num_stages, arch=args.arch,
                divisible=set(filter(None, args.divisible.split(","))),
                unaligned=set(filter(None, args.unaligned.split(","))))
    print(f"{args.kernel} sm_{args.arch}, {args.num_warps} warps: " + ", ".join(f"{k} {v}" for k, v in got.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
