"""`twinspark quantize`: write a quantized copy of a checkpoint (fp8 / w4a16), or run exllamav3's EXL3 converter."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

EXL3_NEEDS = ("EXL3 quantization is a trellis search with calibration that runs in exllamav3's CUDA extension: "
              "`twinspark quantize --format exl3` needs a CUDA GPU and exllamav3 (pip install -e \".[gpu]\")")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "quantize", help="write a quantized copy of a checkpoint (fp8, w4a16; exl3 via exllamav3 on a GPU)",
        description="Quantize a checkpoint shard by shard (one output shard in memory at a time): the same shard "
                    "files and key names, each quantized linear stored as its format's tensors, quantization_config "
                    "in config.json, the index rewritten, tokenizer files copied. Kept dense: embeddings, lm_head, "
                    "the MoE router, KDA gate projections, the indexer's key head and weights, the vision tower, and "
                    "linears whose dims are not whole blocks / groups. The output loads in `generate`, `up` and "
                    "`serve-rank` like any checkpoint. --format exl3 runs exllamav3's own converter (CUDA GPU).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, metavar="IN", help="input checkpoint directory (bf16 / fp32, or one "
                   "already quantized in another format: its quantized modules are copied as they are)")
    p.add_argument("--out", required=True, metavar="OUT", help="output directory (created if missing)")
    p.add_argument("--format", required=True, choices=("fp8", "w4a16", "exl3"),
                   help="fp8: e4m3 weights with block (or per-channel) float32 scales; w4a16: symmetric int4 in "
                        "groups along the input dim with float16 scales; exl3: exllamav3's trellis format")
    p.add_argument("--experts-only", action="store_true",
                   help="quantize only the routed experts (what the fused MoE kernel reads); other linears stay as "
                        "they are")
    p.add_argument("--block-size", type=int, default=128, metavar="N",
                   help="fp8: N x N weight blocks per scale; w4a16: N input channels per scale (a multiple of 8). "
                        "A tensor-parallel shard must be whole blocks: small test models need a small N")
    p.add_argument("--per-channel", action="store_true", help="fp8: one scale per output channel instead of blocks")
    p.add_argument("--device", default="cpu", help="where to run the quantization arithmetic (cpu, cuda, cuda:1)")
    p.add_argument("--bits", type=float, default=4.0, help="exl3: bits per weight")
    p.add_argument("--head-bits", type=float, default=6.0, help="exl3: bits per weight of lm_head")
    p.add_argument("--work-dir", default=None, metavar="DIR", help="exl3: exllamav3's working directory "
                   "(default: OUT/.exl3-work)")
    p.set_defaults(func=run)


def _fail(msg: str) -> int:
    print(f"twinspark quantize: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    src = Path(args.model)
    if not (src / "config.json").is_file():
        return _fail(f"--model {args.model}: no config.json there")
    if args.format == "exl3":
        if args.experts_only:
            return _fail("--experts-only is not an exllamav3 option (its converter takes a per-tensor --recipe)")
        return _run_exl3(args)
    if args.block_size < 1 or (args.format == "w4a16" and args.block_size % 8):
        return _fail(f"--block-size {args.block_size}: must be positive (and a multiple of 8 for w4a16)")
    if args.per_channel and args.format != "fp8":
        return _fail("--per-channel is an fp8 option")

    from model.quantize.convert import quantize_checkpoint
    from model.quantize.select import Recipe

    block = None if args.per_channel else args.block_size
    recipe = Recipe(experts=args.format, other=None if args.experts_only else args.format, block=block)
    try:
        s = quantize_checkpoint(src, args.out, recipe, device=args.device)
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    done = ", ".join(f"{n} linears to {f}" for f, n in s.quantized.items()) or "no linear fitted the format"
    print(f"wrote {Path(args.out).resolve()}: {done}; {s.kept} tensors kept dense, {s.already} modules already "
          f"quantized; {s.bytes_in / 2**20:.1f} MiB -> {s.bytes_out / 2**20:.1f} MiB")
    return 0


def _run_exl3(args: argparse.Namespace) -> int:
    import torch

    missing = [what for what, ok in (("a CUDA GPU", torch.cuda.is_available()),
                                     ("exllamav3", importlib.util.find_spec("exllamav3") is not None)) if not ok]
    if missing:
        return _fail(f"{EXL3_NEEDS}; missing here: {' and '.join(missing)}")
    work = args.work_dir or str(Path(args.out) / ".exl3-work")
    cmd = [sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", args.model, "-o", args.out, "-w", work,
           "-b", str(args.bits), "-hb", str(args.head_bits)]
    print("running exllamav3's converter:", " ".join(cmd), flush=True)
    return subprocess.call(cmd)
