"""`twinspark make-tiny`: write a tiny GLM-5.3-Flash checkpoint for tests and local development."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .presets import PRESETS


def register(subparsers: Any) -> None:
    """Add the `make-tiny` subcommand to the `twinspark` parser."""
    p = subparsers.add_parser(
        "make-tiny",
        help="write a tiny GLM-5.3-Flash checkpoint (real architecture, key names and layout)",
        description="Write a tiny GLM-5.3-Flash checkpoint: config.json in the release spellings, sharded "
                    "safetensors with the release key names (MTP block and vision tower included), a small "
                    "byte-level BPE tokenizer with GLM's special tokens and a GLM-5 chat template. The output is "
                    "byte-identical for a given seed and options.",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the checkpoint into (created if missing)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="weight seed (default: 0)")
    p.add_argument("--layers", type=int, default=8, metavar="L",
                   help="number of text layers; the MTP block is stored after them (default: 8)")
    p.add_argument("--experts", type=int, default=8, metavar="E",
                   help="routed experts per MoE layer, top-2 routing (default: 8)")
    p.add_argument("--index-topk", type=int, default=64, metavar="K",
                   help="DSA indexer top-k in tokens, a multiple of the k-pool size 4 (default: 64)")
    p.add_argument("--layer-pattern", default=None, metavar="PATTERN",
                   help="one letter per layer: K = KDA linear attention, M = MLA with DSA indexer "
                        "(default: the release's 3:1 layout, M iff layer %% 4 == 3)")
    p.add_argument("--indexer-pattern", default=None, metavar="PATTERN",
                   help="one letter per layer: F = full indexer, S = reuse the nearest earlier full layer's "
                        "selection (default: all F)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="storage dtype; the router bias, KDA convs and gate params and mHC base/scale stay float32 "
                        "(default: bfloat16)")
    p.add_argument("--format", default="dense", metavar="dense|RECIPE",
                   help="dense: every tensor in --dtype; exl3[:BITS]: hidden 128 and MLPs 512 wide, every MLP linear "
                        "that is whole 128 x 128 tiles on each of 4 virtual shards (dense MLP, shared and routed "
                        "experts, MTP eh_proj) stored as random EXL3 trellises in exllamav3's names and dtypes at an "
                        "average of BITS bits per weight (1-8, default 4; e.g. exl3:2.5, exl3:3.0): each linear a "
                        "whole or half rate (half rates need mul1), listed in quantization_config.json; attention in "
                        "--dtype whatever its dims; int2, int3, int4, int8 [:gGROUP]: the experts 128 wide (the "
                        "preset int: every MLP linear is then whole groups of 32 on each of 4 virtual shards), every "
                        "linear `quantize` would pack stored as random codes of that many bits with bfloat16 scales "
                        "in groups of GROUP (default: the group `quantize` picks for these dims, 32 for int3 and 16 "
                        "for the others, so attention's o_proj fits too except at int3); or a quantize recipe, "
                        "EXPERTS+OTHER[+HEAD] (e.g. int3:g32+fp8+fp8: int3 experts, fp8 for the rest and lm_head), "
                        "each part drawn at random in its format (default: dense)")
    p.add_argument("--bits", type=float, default=None, help="exl3: the same as --format exl3:BITS")
    p.add_argument("--codebook", choices=("mul1", "mcg", "3inst"), default="mul1",
                   help="exl3: trellis codebook (exllamav3's default: mul1)")
    p.add_argument("--preset", choices=tuple(PRESETS), default="default",
                   help="named dimensions: default = the CPU test model; exl3 = hidden 128 and MLPs 512 wide (what "
                        "--format exl3 writes; a dense model for `quantize --format exl3:BITS`); exllamav3 = the "
                        "smallest dims at which exllamav3 runs the whole model (hidden 128, KDA heads of 128, MLA "
                        "latent 128, a calm init; use with --format exl3 for an EXL3 checkpoint exllamav3 loads); "
                        "int = the experts 128 wide (what --format int3 writes; a dense model for `quantize --format "
                        "int3`) (default: default)")
    p.add_argument("--drafter", choices=("none", "dflash"), default="none",
                   help="dflash: also write a tiny random DFlash2 drafter (z-lab's block diffusion, config.json and "
                        "safetensors in the published names) for this target into OUT/dflash2, with the same seed "
                        "(default: none)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here so `twinspark --help` and other subcommands do not pay for torch/tokenizers imports.
    from model.quantize.select import EXL3_DEFAULT_BITS, INT_FORMATS, recipe_and_bits

    from . import write_tiny

    try:
        if args.format == "dense" and args.bits is not None:
            raise ValueError(f"--bits {args.bits:g} is EXL3's bits per weight; --format is dense")
        recipe = None if args.format == "dense" else recipe_and_bits(args.format, args.bits)
        ckpt = write_tiny(args.out, seed=args.seed, layers=args.layers, experts=args.experts,
                          index_topk=args.index_topk, layer_pattern=args.layer_pattern,
                          indexer_pattern=args.indexer_pattern, dtype=args.dtype, progress=True,
                          format=args.format, exl3_bits=recipe.exl3_bits if recipe else EXL3_DEFAULT_BITS,
                          exl3_codebook=args.codebook, preset=args.preset)
    except ValueError as e:  # bad pattern / sizes / recipe / bitrate: a one-line message, not a traceback
        print(f"make-tiny: {e}", file=sys.stderr)
        return 2
    formats = recipe.formats if recipe else ()
    ints = "/".join(f for f in formats if f in INT_FORMATS)
    s = ckpt.spec
    print(f"wrote tiny GLM-5.3-Flash checkpoint to {ckpt.path.resolve()}")
    print(f"  params: {ckpt.num_params:,} stored ({ckpt.num_text_params:,} text model, rest MTP block + vision tower), "
          f"dtype {ckpt.dtype}, seed {args.seed}"
          + (f", EXL3 {recipe.exl3_bits:g} bits ({args.codebook}) MLPs" if "exl3" in formats else "")
          + (f", {ints} linears in groups of {ckpt.group}" if ckpt.group else "")
          + (f", lm_head {recipe.head}" if recipe and recipe.head else ""))
    print(f"  layers: {s.layer_pattern} (K=KDA, M=MLA+DSA)  indexer: {s.indexer_pattern}  "
          f"experts: {s.n_routed_experts} top-{s.num_experts_per_tok}  index_topk: {s.index_topk}  vocab: {s.vocab_size}")
    print(f"  preset: {ckpt.preset}  hidden: {s.hidden_size}  KDA heads: {s.linear_num_heads} x {s.linear_head_dim}  "
          f"MLA: {s.num_attention_heads} heads, latent {s.kv_lora_rank}, nope / v {s.qk_nope_head_dim} / "
          f"{s.v_head_dim}")
    print("  files:")
    for f in ckpt.files:
        print(f"    {f.name}  ({f.stat().st_size:,} bytes)")
    if args.drafter == "dflash":
        from .dflash_writer import DRAFTER_DIR, write_tiny_dflash

        try:
            files = write_tiny_dflash(ckpt.path / DRAFTER_DIR, ckpt.path, seed=args.seed, dtype=args.dtype)
        except ValueError as e:  # e.g. a target too shallow for the reference's choice of layers
            print(f"make-tiny: --drafter dflash: {e}", file=sys.stderr)
            return 2
        print(f"wrote tiny DFlash2 drafter to {files[0].parent.resolve()}")
        for f in files:
            print(f"    {f.name}  ({f.stat().st_size:,} bytes)")
    return 0
