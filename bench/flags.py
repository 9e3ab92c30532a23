"""The flags several benches take, declared once, and the parser every bench starts from. The serving flags are the
services' own declarations (services/common/shared_flags.py) without their environment variables: a bench run is set
by its command line alone, so a deployment's TWINSPARK_* settings in the shell never change what a bench measures."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from services.common import shared_flags as shared
from services.common.flags import Flag


def parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """A bench's parser: its run command (`python -m bench.<name>`) as the usage line, its module text as the help."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add(parser: argparse.ArgumentParser, spec: Flag, help: str = "", **changes) -> None:
    """Add a flag to a bench's parser, without its environment variable (`help`, `changes`: this bench's)."""
    replace(spec, env=None, **({"help": help} if help else {}), **changes).add(parser, {})


def ints(text: str) -> list[int]:
    """A comma-separated list of integers ("1,4,16")."""
    return [int(x) for x in text.split(",") if x.strip()]


LAYERS = Flag("layers", "text layers (default 4: KKKM)", default="4", type=int)
LAYER_PATTERN = Flag("layer-pattern", "K/M per layer (default: the release's 3:1 layout)")
VIRTUAL = Flag("virtual", "virtual TP shards (default 1: one product per weight)", default="1", type=int)
SEED = Flag("seed", "seed of the random weights and prompts", default="0", type=int)
TINY = Flag("tiny", "make-tiny dimensions on the CPU: a smoke test of this script", switch=True)
OUT = Flag("out", "folder for the results (default bench/results)", type=Path)
BUDGET_S = Flag("budget-s", "skip what has not started after this many seconds", type=float)
# The model benches pick their device and dtype themselves when these are not given.
DEVICE = replace(shared.DEVICE, default=None, choices=None, help="default: cuda if available (cpu with --tiny)")
DTYPE = replace(shared.DTYPE, help="weights / activations (default bf16; float32 with --tiny)")
KV_CACHE_DTYPE = replace(shared.KV_CACHE_DTYPE, help="storage of the MLA latent / indexer rows, as serve-rank's flag")
# The load benches: what they send through HTTP, and the stack they start.
CONCURRENCY = Flag("concurrency", "requests in flight at once, a level per value", type=ints, metavar="N,N,...")
PROMPT_LEN = Flag("prompt-len", "prompt tokens per request", type=int)
OUTPUT_LEN = Flag("output-len", "output tokens per request (ignore_eos)", type=int)
RANKS_DEVICE = Flag("device", "the ranks' device (default cuda)", default="cuda")
