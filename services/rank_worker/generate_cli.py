"""`twinspark generate`: offline generation from a checkpoint, spawning one process per rank for TP > 1."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from services.common import shared_flags as shared
from services.common.flags import add_flags, flag, from_args


@dataclass(frozen=True, kw_only=True)
class GenerateSettings:
    """The model and device flags are the serving ones (environment defaults included); the request's own flags
    have no variables: they describe one run, not a deployment."""

    model: str = flag(shared.MODEL, required=True)
    prompt: str | None = flag("prompt", "prompt text (tokenized as is, no chat template)", env=None, one_of="source")
    ids: str | None = flag("ids", "prompt token ids, comma separated", env=None, one_of="source")
    max_tokens: int = flag("max-tokens", "tokens to generate at most", default="32", type=int, env=None)
    temperature: float = flag("temperature", "0 = greedy (default)", default="0", type=float, env=None)
    top_p: float = flag("top-p", "nucleus sampling mass", default="1", type=float, env=None)
    top_k: int = flag("top-k", "0 = off", default="0", type=int, env=None)
    min_p: float = flag("min-p", "minimum probability relative to the top token", default="0", type=float, env=None)
    seed: int = flag("seed", "sampling seed", default="0", type=int, env=None)
    ignore_eos: bool = flag("ignore-eos", "keep generating past end-of-sequence tokens", switch=True, env=None)
    tp: int = flag(shared.TP)
    device: str = flag(shared.DEVICE)
    dtype: str | None = flag(shared.DTYPE)
    kv_cache_dtype: str = flag(shared.KV_CACHE_DTYPE)
    json: bool = flag("json", 'print {"token_ids": [...], "text": "..."}', switch=True, env=None)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate tokens offline from a checkpoint",
                       description="Offline generation (no services). Prints the text, or JSON with --json.")
    add_flags(GenerateSettings, p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return generate(from_args(GenerateSettings, args))


def generate(s: GenerateSettings) -> int:
    import torch
    from tokenizers import Tokenizer

    from model.row_store import KV_CACHE_DTYPES
    from services.rank_worker import offline

    model_dir = Path(s.model)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if s.ids is not None:
        try:
            prompt = [int(x) for x in s.ids.split(",") if x.strip()]
        except ValueError:
            print("error: --ids takes comma-separated integers", file=sys.stderr)
            return 2
    else:
        prompt = tokenizer.encode(s.prompt, add_special_tokens=False).ids
    req = offline.GenerateRequest(prompt_ids=tuple(prompt), max_tokens=s.max_tokens, temperature=s.temperature,
                                  top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, seed=s.seed, ignore_eos=s.ignore_eos)
    try:
        tokens = offline.generate(model_dir, req, tp=s.tp, device=s.device,
                                  dtype=getattr(torch, shared.compute_dtype(s.dtype, s.device)),
                                  kv_dtype=KV_CACHE_DTYPES[s.kv_cache_dtype])
    except (ValueError, RuntimeError) as e:  # a checkpoint the loader refuses (e.g. a split off the tile grid)
        print(f"generate: {e}", file=sys.stderr)
        return 1
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    print(json.dumps({"token_ids": tokens, "text": text}) if s.json else text)
    return 0
