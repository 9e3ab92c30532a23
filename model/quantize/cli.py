"""`twinspark quantize`: write a quantized copy of a checkpoint (fp8, w4a16, int2 / int3 / int4 / int8, EXL3 at a
chosen bitrate), or run exllamav3's own EXL3 converter (calibrated, CUDA GPU) with --exllamav3."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

from model.quantize.select import EXL3_DEFAULT_BITS, RECIPE_HELP, VIRTUAL_SHARDS, Recipe, recipe_and_bits

EXL3_NEEDS = ("exllamav3's converter is a trellis search with calibration that runs in its CUDA extension: "
              "`twinspark quantize --exllamav3` needs a CUDA GPU and exllamav3 (pip install -e \".[gpu]\")")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "quantize", help="write a quantized copy of a checkpoint (fp8, w4a16, int2/int3/int4/int8, exl3[:BITS])",
        description="Quantize a checkpoint shard by shard (one output shard in memory at a time): the same shard "
                    "files and key names, each quantized linear stored as its format's tensors, quantization_config "
                    "in config.json, the index rewritten, tokenizer files copied. Kept dense: embeddings, lm_head "
                    "(unless the recipe's HEAD is fp8), the MoE router, KDA gate projections, the indexer's key head "
                    "and weights, the vision tower, and every linear that is not whole blocks / groups / 128-wide "
                    "EXL3 tiles on each virtual shard the loader cuts it into, so the output loads in `generate`, "
                    "`up` and `serve-rank` at every TP size that divides --virtual-shards (the plan is printed "
                    "first). One run writes a whole recipe (int3+fp8: int3 experts, fp8 for the rest), or one "
                    "format on top of an earlier run's. The int formats round to nearest here; a second int run "
                    "quantizes what the first left (e.g. int3 --experts-only, then int4) in the first run's group "
                    "size. EXL3 is encoded here, on --device, by twinspark's beam search "
                    "without calibration; --exllamav3 runs exllamav3's own converter.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, metavar="IN", help="input checkpoint directory (bf16 / fp32, or one "
                   "already quantized in another format: its quantized modules are copied as they are)")
    p.add_argument("--out", required=True, metavar="OUT", help="output directory (created if missing)")
    p.add_argument("--format", required=True, metavar="RECIPE",
                   help="fp8: e4m3 weights with block (or per-channel) float32 scales; w4a16: symmetric int4 in "
                        "groups along the input dim with float16 scales; int2, int3, int4, int8 [:gGROUP]: "
                        "symmetric integers of that many bits in groups along the input dim with signed bfloat16 "
                        "scales, packed as a bit stream (GROUP: the same as --block-size; e.g. int3:g64); "
                        "exl3[:BITS]: exllamav3's trellis format at "
                        "an average of BITS bits per weight, any number from 1 to 8 "
                        f"(default {EXL3_DEFAULT_BITS:g}; e.g. exl3:2.0, exl3:2.5, exl3:3.0): each linear gets a "
                        "whole or half rate (half rates need the mul1 codebook) so the average lands on BITS, "
                        "attention first, routed experts last; what each got is in the output's "
                        "quantization_config.json. One format, or a recipe in one run: " + RECIPE_HELP +
                        " (lm_head fp8 at the release's vocabulary needs --virtual-shards 2 or 1, and serve-rank "
                        "the same: its 128-row blocks do not divide into 4 shards)")
    p.add_argument("--experts-only", action="store_true",
                   help="quantize only the routed experts (what the fused MoE kernel reads); other linears stay as "
                        "they are")
    p.add_argument("--block-size", type=int, default=None, metavar="N",
                   help="fp8: N x N weight blocks per scale; w4a16: N input channels per scale (a multiple of 8); "
                        "int: N input channels per scale, N x bits a multiple of 32 (int3: 32, 64, 128). Default: "
                        "chosen from the shard plan, the largest of 128/64/32/16/8 (those the format takes) that "
                        "leaves no linear dense that the smallest would pack (128 at GLM-5.3-Flash's dims; for the "
                        "tiny test model 8, int3 32, int2 16); a second int run takes the first run's")
    p.add_argument("--per-channel", action="store_true", help="fp8: one scale per output channel instead of blocks")
    p.add_argument("--virtual-shards", type=int, default=VIRTUAL_SHARDS, metavar="V",
                   help="the virtual shards the output is planned for (serve-rank's --virtual-shards): every packed "
                        "linear is whole tiles on each of them, so it loads at every TP size that divides V")
    p.add_argument("--codebook", choices=("mul1", "mcg", "3inst"), default="mul1",
                   help="exl3: trellis codebook (exllamav3's default: mul1; only mul1 has the half rates)")
    p.add_argument("--device", default="cpu", help="where to run the quantization arithmetic (cpu, cuda, cuda:1)")
    p.add_argument("--bits", type=float, default=None, help="exl3: the same as --format exl3:BITS")
    p.add_argument("--exllamav3", action="store_true", help="exl3: run exllamav3's own converter (calibrated; a "
                   "CUDA GPU and exllamav3) instead of twinspark's encoder, with --format's BITS, --head-bits, "
                   "--work-dir")
    p.add_argument("--head-bits", type=float, default=6.0, help="--exllamav3: bits per weight of lm_head")
    p.add_argument("--work-dir", default=None, metavar="DIR", help="--exllamav3: its working directory "
                   "(default: OUT/.exl3-work)")
    p.set_defaults(func=run)


def _fail(msg: str) -> int:
    print(f"twinspark quantize: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    src = Path(args.model)
    if not (src / "config.json").is_file():
        return _fail(f"--model {args.model}: no config.json there")
    try:
        recipe = _recipe(args)
    except ValueError as e:  # a bad term, bitrate, or an int group that is not whole words
        return _fail(f"--format {e}")
    if not recipe.formats:
        return _fail(f"--format {args.format} quantizes nothing (bf16 is a recipe's 'keep dense')")
    if args.exllamav3:
        if recipe.formats != ("exl3",) or recipe.other is None:
            return _fail("--exllamav3 runs exllamav3's converter: --format exl3[:BITS], no --experts-only (its "
                         "converter takes a per-tensor --recipe)")
        return _run_exllamav3(args, recipe.exl3_bits)
    if args.block_size is not None and (args.block_size < 1 or ("w4a16" in recipe.formats and args.block_size % 8)):
        return _fail(f"--block-size {args.block_size}: must be positive (and a multiple of 8 for w4a16)")
    if args.per_channel and recipe.formats != ("fp8",):
        return _fail("--per-channel is an fp8 option")
    if recipe.group and args.block_size and recipe.group != args.block_size:
        return _fail(f"--format {args.format} and --block-size {args.block_size} disagree (give one)")
    if args.virtual_shards < 1:
        return _fail(f"--virtual-shards {args.virtual_shards}: must be positive")

    from model.quantize.convert import quantize_checkpoint

    try:
        s = quantize_checkpoint(src, args.out, recipe, device=args.device, choose_block=args.block_size is None,
                                log=lambda line: print(line, flush=True))
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    done = ", ".join(f"{n} linears to {f}" for f, n in s.quantized.items())
    print(f"wrote {Path(args.out).resolve()}: {done}; {s.kept} tensors kept dense, {s.already} modules already "
          f"quantized; {s.bytes_in / 2**20:.1f} MiB -> {s.bytes_out / 2**20:.1f} MiB")
    return 0


def _recipe(args: argparse.Namespace) -> Recipe:
    """--format's recipe with --bits, --experts-only, --block-size, --per-channel, --codebook and --virtual-shards."""
    if args.experts_only and "+" in args.format:
        raise ValueError(f"{args.format}: --experts-only takes one FORMAT (a recipe says it as EXPERTS+bf16)")
    recipe = recipe_and_bits(args.format, args.bits, block=None if args.per_channel else args.block_size or 128,
                             exl3_codebook=args.codebook, virtual=args.virtual_shards)
    return dataclasses.replace(recipe, other=None) if args.experts_only else recipe


def _run_exllamav3(args: argparse.Namespace, bits: float) -> int:
    import torch

    missing = [what for what, ok in (("a CUDA GPU", torch.cuda.is_available()),
                                     ("exllamav3", importlib.util.find_spec("exllamav3") is not None)) if not ok]
    if missing:
        return _fail(f"{EXL3_NEEDS}; missing here: {' and '.join(missing)}")
    work = args.work_dir or str(Path(args.out) / ".exl3-work")
    cmd = [sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", args.model, "-o", args.out, "-w", work,
           "-b", str(bits), "-hb", str(args.head_bits), "-cb", args.codebook]
    print("running exllamav3's converter:", " ".join(cmd), flush=True)
    return subprocess.call(cmd)
