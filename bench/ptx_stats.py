"""What a Triton kernel compiles to for a GPU that is not here: barriers, warp shuffles, PTX size, shared memory.

    python -m bench.ptx_stats kernels.gpu.mhc:_pre_row_kernel --num-warps 16 \\
        --signature s_ptr=*bf16,ws_ptr=*fp32,base_ptr=*fp32,scale_ptr=*fp32,nw_ptr=*bf16,h_ptr=*bf16,\\
post_ptr=*fp32,comb_ptr=*fp32,D=i32,hc_eps=fp32,norm_eps=fp32,rms_eps=fp32 \\
        --constexprs CHUNKS=64,CHUNKS_P2=64,ITERS=20,HC=4,BLOCK_D=4096 --divisible D
    -> kernels.gpu.mhc:_pre_row_kernel sm_90, 16 warps: bar_sync 17, shfl 156, ptx_lines 2311, cp_async 0, wgmma 0,
       shared_bytes 256, registers 60, spill_bytes 0

compiles the kernel with Triton's own compiler and ptxas for sm_90 (default) on any machine, no GPU needed, and
prints the counts. Why: a decode step's small kernels are latency-bound, and what they wait on shows in the code
before any timing — a reduction across a program's warps costs a `bar.sync` and a round trip through shared memory
(the mHC decode kernel's Sinkhorn iterations were 57 of its 78 barriers, before its sums were kept in a warp). Device time is short; this narrows what
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
import importlib
import sys

from bench import flags
from bench.triton_build import stats


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


def main(argv: list[str] | None = None) -> int:
    ap = flags.parser("bench.ptx_stats", __doc__)
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
