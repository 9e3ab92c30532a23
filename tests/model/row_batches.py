"""Many sequences part-way through their prompts, and packed forwards of any subset of them: the material of the
row-invariance checks (docs/design.md §5.2), shared by the compute-dtype and the fp8-cache suites."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from model.batch import Batch
from model.cache import PagedCache
from model.model import Glm5Model
from tests.model.reference import clone_cache, fresh_cache, random_ids, run_chunks, table

SEQS = 17
CAP = 64


@dataclass
class Prepared:
    model: Glm5Model
    cache: PagedCache
    seqs: list[list[int]]
    done: list[int]  # tokens of each sequence already in the cache


def prepare(model: Glm5Model, kv_dtype: torch.dtype | None = None) -> Prepared:
    """17 sequences with 20..36 tokens already cached, plus one more token (or chunk) each to compute next."""
    cache = fresh_cache(model, CAP, slots=SEQS, kv_dtype=kv_dtype)
    seqs = [random_ids(40, seed=100 + s) for s in range(SEQS)]
    done = [20 + s for s in range(SEQS)]
    for s in range(SEQS):
        run_chunks(model, cache, seqs[s][: done[s]], [done[s]], slot=s, capacity=CAP)
    return Prepared(model, cache, seqs, done)


def packed_step(p: Prepared, members: list[int], chunk: dict[int, int]) -> tuple[dict[int, torch.Tensor], PagedCache]:
    """One packed forward of the given sequences (chunk[s] new rows each) on a copy of the prepared cache: logits
    per sequence, and the cache it left behind."""
    rows = [p.seqs[s][p.done[s] : p.done[s] + chunk[s]] for s in members]
    batch = Batch(token_ids=torch.tensor(sum(rows, [])), starts=[p.done[s] for s in members],
                  lengths=[len(r) for r in rows], block_tables=torch.tensor([table(s, CAP) for s in members]),
                  slots=members, logit_rows=torch.arange(sum(len(r) for r in rows)))
    cache = clone_cache(p.cache)
    logits = p.model.forward(batch, cache).logits.split([len(r) for r in rows])
    return dict(zip(members, logits)), cache


def mixed_batch(others: int, target: int = 0) -> tuple[list[int], dict[int, int]]:
    """`target`'s decode row packed mid-batch among `others` random sequences, each contributing a decode row or a
    2-4 row prefill chunk (seeded by `others`) -> (members in batch order, new rows per member)."""
    rng = random.Random(others)
    mates = rng.sample([s for s in range(SEQS) if s != target], others)
    chunk = {s: (1 if rng.random() < 0.5 else rng.randint(2, 4)) for s in mates}
    chunk[target] = 1
    return mates[: others // 2] + [target] + mates[others // 2 :], chunk
