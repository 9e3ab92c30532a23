"""Random weights that speak (issue 54): greedy replies of a model over random weights vary, whatever the recipe,
so an exactness check that compares replies compares more than one token repeated. Offline, on the CPU, through
the model's own forward (`generate_on_model`).

The width: the int codes' mean offset multiplied the all-ones input direction by about |c| sqrt(in) per linear
(model/random_weights.py, `SIGNED_SCALE_CODECS`); int2's c at 256 wide gives about what w4a16's gives at the
release's 4096, so the old draw's collapse shows here at a CPU test's cost.
"""

from __future__ import annotations

import random

import pytest
import torch

from bench.random_weights import TINY_VOCAB, build_model
from model.checkpoint.spec import TinySpec
from model.parallel import Sharding
from model.quantize.select import Recipe
from model.random_weights import RandomWeightReader
from services.rank_worker.offline import GenerateRequest, generate_on_model

SPEC = TinySpec.tiny(vocab_size=TINY_VOCAB, hidden_size=256, num_hidden_layers=4, num_nextn_predict_layers=0)
GROUP = 16  # int2's smallest group, and whole groups of every linear the recipes pack at this width
REPLY = 32
VARIED = 8  # distinct tokens in a reply's first 32 that make it more than a token or two repeated


def _recipe(spec: str | None) -> Recipe | None:
    return Recipe.parse(spec, block=GROUP) if spec else None


def _prompts(n: int = 12, seed: int = 99) -> list[tuple[int, ...]]:
    """Random ids of bench.concurrency_check's range, 3 to 16 of them."""
    rng = random.Random(seed)
    return [tuple(rng.randrange(5, 1000) for _ in range(rng.choice((3, 8, 16)))) for _ in range(n)]


@pytest.mark.parametrize("recipe", ["int2:g16", "w4a16", "fp8", None])
def test_greedy_replies_vary(recipe: str | None) -> None:
    torch.manual_seed(0)
    model, _ = build_model(SPEC, device="cpu", dtype=torch.float32, recipe=_recipe(recipe))
    replies = [generate_on_model(model, GenerateRequest(p, max_tokens=REPLY, ignore_eos=True)) for p in _prompts()]
    varied = [len(set(r[:REPLY])) for r in replies]
    assert sum(d >= VARIED for d in varied) >= 10, f"distinct tokens per reply: {varied}"


@pytest.mark.parametrize("recipe", ["w4a16", "int2:g16", "int3:g32", "int4", "fp8", "exl3"])
def test_quantized_draws_average_zero(recipe: str) -> None:
    """The cause itself: a linear's entries average zero as a normal draw's do (a mean shared by every linear is the
    direction they all amplify)."""
    reader = RandomWeightReader(SPEC, Sharding(virtual=1), torch.float32, "cpu", recipe=_recipe(recipe))
    key = "model.language_model.layers.0.mlp.gate_proj.weight"
    assert reader.format_of(key) is not None
    w = reader.full(key)
    assert abs(w.mean() / w.std()) < 0.05
