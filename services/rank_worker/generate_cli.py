"""`twinspark generate`: offline generation from a checkpoint, spawning one process per rank for TP > 1."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from model.row_store import KV_CACHE_DTYPES

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate tokens offline from a checkpoint",
                       description="Offline generation (no services). Prints the text, or JSON with --json.")
    p.add_argument("--model", default=os.environ.get("TWINSPARK_MODEL"), required="TWINSPARK_MODEL" not in os.environ,
                   help="checkpoint directory (env TWINSPARK_MODEL)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized as is, no chat template)")
    src.add_argument("--ids", help="prompt token ids, comma separated")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--tp", type=int, default=int(os.environ.get("TWINSPARK_TP", "1")), help="tensor-parallel ranks")
    p.add_argument("--device", default=os.environ.get("TWINSPARK_DEVICE", "cpu"), choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES),
                   help="compute dtype (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--kv-cache-dtype", default=os.environ.get("TWINSPARK_KV_CACHE_DTYPE", "auto"),
                   choices=sorted(KV_CACHE_DTYPES), help="storage of the MLA latent + indexer cache rows: auto = the "
                   "compute dtype; fp8 (= fp8_e4m3) = e4m3 with a per-row scale (env TWINSPARK_KV_CACHE_DTYPE)")
    p.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": "..."}')
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tokenizers import Tokenizer

    from services.rank_worker.offline import GenerateRequest, generate

    model_dir = Path(args.model)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if args.ids is not None:
        try:
            prompt = [int(x) for x in args.ids.split(",") if x.strip()]
        except ValueError:
            print("error: --ids takes comma-separated integers", file=sys.stderr)
            return 2
    else:
        prompt = tokenizer.encode(args.prompt, add_special_tokens=False).ids
    dtype = _DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    req = GenerateRequest(prompt_ids=tuple(prompt), max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                          ignore_eos=args.ignore_eos)
    try:
        tokens = generate(model_dir, req, tp=args.tp, device=args.device, dtype=dtype,
                          kv_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype])
    except (ValueError, RuntimeError) as e:  # a checkpoint the loader refuses (e.g. a split off the tile grid)
        print(f"generate: {e}", file=sys.stderr)
        return 1
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    print(json.dumps({"token_ids": tokens, "text": text}) if args.json else text)
    return 0
