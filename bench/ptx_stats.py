"""What a Triton kernel compiles to for a GPU that is not here: barriers, warp shuffles, PTX size, shared memory.

    python -m bench.ptx_stats kernels.gpu.mhc:_pre_decode_kernel --num-warps 16 \\
        --signature s_ptr=*bf16,ws_ptr=*fp32,base_ptr=*fp32,scale_ptr=*fp32,nw_ptr=*bf16,h_ptr=*bf16,\\
post_ptr=*fp32,comb_ptr=*fp32,D=i32,hc_eps=fp32,norm_eps=fp32,rms_eps=fp32 \\
        --constexprs CHUNKS=64,CHUNKS_P2=64,ITERS=20,HC=4,BLOCK_D=4096
    -> kernels.gpu.mhc:_pre_decode_kernel sm_90, 16 warps: bar_sync 78, shfl 158, ptx_lines 2859, shared_bytes 512

compiles the kernel with Triton's own compiler and ptxas for sm_90 (default) on any machine, no GPU needed, and
prints the counts. Why: a decode step's small kernels are latency-bound, and what they wait on shows in the code
before any timing — a reduction across a program's warps costs a `bar.sync` and a round trip through shared memory
(the mHC decode kernel's Sinkhorn iterations were 57 of its 78 barriers). Device time is short; this narrows what
to time.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
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
          arch: int = 90) -> dict[str, int]:
    """Compile `kernel` (a @triton.jit function) for sm_<arch>: counts of bar.sync, shfl.sync and PTX lines, and
    its shared memory bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction
    if not isinstance(kernel, JITFunction):  # Triton's whole library is Python functions in that mode
        raise RuntimeError("kernels made under TRITON_INTERPRET cannot be compiled: run this in a process without it")
    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    ptx = compiled.asm["ptx"]
    return {"bar_sync": ptx.count("bar.sync"), "shfl": len(re.findall(r"\bshfl\.sync", ptx)),
            "ptx_lines": ptx.count("\n"), "shared_bytes": int(compiled.metadata.shared)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ptx_stats", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", help="module:name of a @triton.jit function, e.g. kernels.gpu.mhc:_pre_decode_kernel")
    ap.add_argument("--signature", type=_pairs, required=True,
                    help="its runtime arguments' types, NAME=TYPE,... (*fp32, *bf16, i32, fp32, ...)")
    ap.add_argument("--constexprs", type=_pairs, default={}, help="its constexpr arguments, NAME=VALUE,...")
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: Hopper)")
    args = ap.parse_args(argv)
    module, _, name = args.kernel.partition(":")
    kernel = getattr(importlib.import_module(module), name)
    got = stats(kernel, args.signature, {k: _constexpr(v) for k, v in args.constexprs.items()},
                num_warps=args.num_warps, arch=args.arch)
    print(f"{args.kernel} sm_{args.arch}, {args.num_warps} warps: " + ", ".join(f"{k} {v}" for k, v in got.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
