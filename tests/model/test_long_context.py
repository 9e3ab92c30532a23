"""A needle in a long prompt, on the CPU path (hooked score check): the tiny model prefills 4,096 tokens in
grid-aligned chunks, its indexer scoring k-pools in blocks of 256 (so the running top-k crosses three block
boundaries, as a 1M prompt crosses hundreds at the default 1,024), and the indexer's score of the needle's pool (at
90% of the prompt) is raised by a hook, as a trained indexer scores a relevant passage. Then:
- every full indexer layer selects the needle's positions for the last prompt row and for the next decode row;
- the decode row attends exactly its selection: changing the needle's cached latent rows changes its logits,
  changing the rows of a far pool it did not select leaves them bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernels import dsa
from ops import reference
from model.batch import Batch
from tests.model.reference import BLOCK, our_model, random_ids

LENGTH = 4096
CHUNK = 1024
POOL_BLOCK = 256
NEEDLE = int(LENGTH * 0.9)  # a position inside the needle's pool


@pytest.fixture(scope="module")
def needle_run(tiny_default):
    model = our_model(tiny_default)
    kpool = model.cfg.index_kpool
    assert LENGTH // kpool >= 4 * POOL_BLOCK, "the prompt must span several blocks of k-pools"
    needle_pool = NEEDLE // kpool
    selected: list[torch.Tensor] = []  # the last row's selection of every select_positions call
    original = dsa.select_positions

    def hooked(scores_of, n_pools, positions, *args, **kwargs):
        def boosted(p0: int, p1: int) -> torch.Tensor:
            s = scores_of(p0, p1)
            if p0 <= needle_pool < p1:
                s[:, needle_pool - p0] += 1e4
            return s
        out = original(boosted, n_pools, positions, *args, **kwargs)
        selected.append(out[-1])
        return out

    reference.dsa.select_positions, default_block = hooked, reference.POOL_BLOCK
    reference.POOL_BLOCK = POOL_BLOCK
    try:
        ids = random_ids(LENGTH + 1, seed=7)
        blocks = -(-(LENGTH + 1) // BLOCK)
        cache = model.new_cache(num_blocks=blocks, block_size=BLOCK, num_slots=2)
        table = list(range(blocks))
        for s in range(0, LENGTH, CHUNK):
            model.forward(Batch.single(ids[s : s + CHUNK], s, table, slot=0), cache)
        prompt_selections = list(selected)
        cache.copy_states([(0, 1)])  # the KDA state after the prompt, to replay the decode step from it

        def decode() -> torch.Tensor:
            cache.copy_states([(1, 0)])
            selected.clear()
            return model.forward(Batch.single(ids[LENGTH:], LENGTH, table, slot=0), cache).logits[0]

        yield model, cache, decode, prompt_selections, selected, needle_pool
    finally:
        reference.dsa.select_positions, reference.POOL_BLOCK = original, default_block


def test_the_needle_is_selected(needle_run) -> None:
    model, _, decode, prompt_selections, selected, needle_pool = needle_run
    kpool = model.cfg.index_kpool
    needle = set(range(needle_pool * kpool, (needle_pool + 1) * kpool))
    full_layers = sum(t == "full" for t in (model.cfg.indexer_types[i] for i in model.cfg.mla_layers))
    last_chunk = prompt_selections[-full_layers:]  # the chunk holding the last prompt row, every full layer
    assert len(last_chunk) == full_layers >= 1
    assert all(needle <= set(sel.tolist()) for sel in last_chunk)
    decode()
    assert len(selected) == full_layers and all(needle <= set(sel.tolist()) for sel in selected)


def test_the_decode_row_attends_its_selection_only(needle_run) -> None:
    model, cache, decode, _, selected, needle_pool = needle_run
    kpool = model.cfg.index_kpool
    base = decode()
    chosen = set().union(*(set(s.tolist()) for s in selected))
    far_pool = next(p for p in range(LENGTH // (2 * kpool), LENGTH // kpool)
                    if not chosen & set(range(p * kpool, (p + 1) * kpool)))

    def with_rows_changed(pool: int) -> torch.Tensor:
        saved = {layer: store.data.clone() for layer, store in cache.latent.items()}
        for store in cache.latent.values():
            for pos in range(pool * kpool, (pool + 1) * kpool):
                store.data[pos // BLOCK, pos % BLOCK] += 1.0
        try:
            return decode()
        finally:
            for layer, store in cache.latent.items():
                store.data.copy_(saved[layer])

    assert torch.equal(with_rows_changed(far_pool), base)  # not selected: never read
    assert not torch.equal(with_rows_changed(needle_pool), base)  # selected: attended
    assert torch.equal(decode(), base)  # the cache was put back as it was
