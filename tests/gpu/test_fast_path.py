"""The fused GPU forward at real GLM-5.3-Flash widths (hidden 4096, 288 experts top-8, MLA 64 heads with the DSA
indexer, KDA 64x128; two layers KM: a KDA layer with a dense FFN, an MLA layer with the MoE), random bf16 weights:

- a decode row alone = the same row packed with up to 2,048 other rows (decode rows, a verify window, prompt chunks
  of many lengths): bit-identical logits (docs/design.md §5.1);
- a prompt prefilled whole = in chunks on the 64-token grid: bit-identical logits, and the decode step after it too
  (so the KDA state and the cache rows are identical);
- a CUDA-graph replay of a decode round = the eager forward of the same round: bit-identical; likewise a round of
  verify windows and decode steps, and the KDA states its commit keeps;
- decode rounds with programmatic dependent launch (eager and replayed) = the same rounds with plain launches.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BLOCK = 16
CAP = 4096  # positions per sequence in these tests


@pytest.fixture(scope="module")
def model():
    from bench.random_weights import bench_spec, build_model
    spec = bench_spec(layers=2, layer_pattern="KM")
    m, _ = build_model(spec, device="cuda", dtype=torch.bfloat16, seed=0)
    return m


@pytest.fixture(scope="module")
def quantized_model():
    """The same two layers with W4A16 (int4, group 128) experts, kept packed by the GPU path, the rest bf16."""
    from bench.random_weights import bench_spec, build_model
    from model.quantize.select import Recipe
    spec = bench_spec(layers=2, layer_pattern="KM")
    m, reader = build_model(spec, device="cuda", dtype=torch.bfloat16, seed=0, recipe=Recipe.parse("w4a16+bf16"))
    assert reader.quantized_made > 0
    return m


def _batch(seqs, device="cuda"):
    """seqs: (slot, ids, start, prompt, verify) in decode-class-first order."""
    from model.batch import Batch
    ids = [i for _, new, *_ in seqs for i in new]
    nb = CAP // BLOCK
    return Batch(token_ids=torch.tensor(ids, device=device), starts=[st for _, _, st, _, _ in seqs],
                 lengths=[len(new) for _, new, *_ in seqs],
                 block_tables=torch.tensor([list(range(s * nb, (s + 1) * nb)) for s, *_ in seqs], device=device),
                 slots=[s for s, *_ in seqs], logit_rows=torch.arange(len(ids)), verify=[v for *_, v in seqs],
                 prompt=[p for *_, p, _ in seqs])


def _cache(model, slots: int):
    return model.new_cache(num_blocks=slots * CAP // BLOCK, block_size=BLOCK, num_slots=slots)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 150000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_decode_row_alone_equals_row_among_2048(model):
    _decode_row_alone_vs_2048(model)


def test_quantized_experts_decode_row_alone_equals_row_among_2048(quantized_model):
    _decode_row_alone_vs_2048(quantized_model)


def _decode_row_alone_vs_2048(model) -> None:
    slots = 24
    cache = _cache(model, slots)
    prompts = [_ids(300 + 37 * s, seed=s) for s in range(slots)]
    for s in range(0, slots, 6):  # prefill every sequence's context
        model.forward(_batch([(t, prompts[t], 0, True, False) for t in range(s, s + 6)]), cache)
    target = (5, [123], len(prompts[5]), False, False)
    alone = model.forward(_batch([target]), copy.deepcopy(cache)).logits[0]
    others_decode = [(t, [7 + t], len(prompts[t]), False, False) for t in range(6, 16)]
    verify = [(3, [11, 12, 13, 14, 15], len(prompts[3]), False, True)]
    chunks = [(16 + i, _ids(n, seed=100 + i), len(prompts[16 + i]), True, False)
              for i, n in enumerate((1, 37, 64, 200, 700, 1030))]
    packed = others_decode[:5] + [target] + others_decode[5:] + verify + chunks
    rows = sum(len(x[1]) for x in packed)
    assert rows == 2048
    batch = _batch(packed)
    together = model.forward(batch, copy.deepcopy(cache)).logits[5]
    assert torch.equal(alone, together)


def test_prompt_whole_equals_grid_chunks(model):
    prompt = _ids(300, seed=7)
    whole_cache, chunk_cache = _cache(model, 1), _cache(model, 1)
    whole = model.forward(_batch([(0, prompt, 0, True, False)]), whole_cache).logits
    parts, start = [], 0
    for n in (64, 128, 108):
        parts.append(model.forward(_batch([(0, prompt[start:start + n], start, True, False)]), chunk_cache).logits)
        start += n
    assert torch.equal(whole, torch.cat(parts))
    step = [(0, [42], 300, False, False)]
    assert torch.equal(model.forward(_batch(step), whole_cache).logits, model.forward(_batch(step), chunk_cache).logits)


def _prefilled(model, seqs: int, length: int, grow: int, seed: int):
    """A cache with `seqs` random prompts prefilled (sequence s: length + grow * s tokens), the prompts, and the
    decode graphs over that cache."""
    from model.cuda_graphs import DecodeGraphs
    cache = _cache(model, 8)
    prompts = [_ids(length + grow * s, seed=seed + s) for s in range(seqs)]
    model.forward(_batch([(s, prompts[s], 0, True, False) for s in range(seqs)]), cache)
    return cache, prompts, DecodeGraphs(model, cache)


def test_graph_replay_equals_eager(model):
    cache, prompts, graphs = _prefilled(model, 5, 100, 11, seed=20)
    for step in range(3):
        batch = _batch([(s, [3 + s + step], len(prompts[s]) + step, False, False) for s in range(5)])
        assert graphs.fits(batch)
        eager = model.forward(batch, copy.deepcopy(cache)).logits.clone()
        replay = graphs.run(batch).logits.clone()
        assert torch.equal(eager, replay)


def test_programmatic_launch_equals_plain_launches(model, monkeypatch):
    """kernels/gpu/pdl.py: decode rounds run with programmatic dependent launch, eagerly and as a graph replay, give
    the logits the same rounds give with plain launches (PDL off, as TWINSPARK_PDL=0 sets it), bit for bit."""
    from kernels.gpu import pdl
    if not pdl.enabled():
        pytest.skip("programmatic dependent launch needs sm_90 or later (or TWINSPARK_PDL=0 is set)")
    cache, prompts, graphs = _prefilled(model, 6, 120, 7, seed=60)
    for step in range(4):
        batch = _batch([(s, [9 + s + step], len(prompts[s]) + step, False, False) for s in range(6)])
        with monkeypatch.context() as off:
            off.setattr(pdl, "enabled", lambda: False)
            plain = model.forward(batch, copy.deepcopy(cache)).logits.clone()
        eager = model.forward(batch, copy.deepcopy(cache)).logits.clone()
        replay = graphs.run(batch).logits.clone()
        assert torch.equal(plain, eager) and torch.equal(plain, replay)


def test_window_graph_replay_equals_eager(model):
    """Verify windows of several lengths beside decode steps, replayed by one window graph over three rounds (the
    windows change places and lengths): the logits and a layer's outputs equal the eager forward's, and so do the KDA
    states and conv histories each commit keeps (a different number of drafts accepted per window)."""
    from model.cuda_graphs import DecodeGraphs
    cache = _cache(model, 8)
    prompts = [_ids(90 + 13 * s, seed=40 + s) for s in range(4)]
    model.forward(_batch([(s, prompts[s], 0, True, False) for s in range(4)]), cache)
    graphs = DecodeGraphs(model, cache)
    ends = [len(p) for p in prompts]
    rounds = [[5, 1, 3, 1], [1, 4, 1, 6], [2, 2, 1, 4]]  # rows per sequence (1: a decode step)
    for r, lengths in enumerate(rounds):
        seqs = [(s, _ids(n, seed=100 * r + s), ends[s], False, n > 1) for s, n in enumerate(lengths)]
        batch = _batch(seqs)
        assert graphs.fits(batch)
        accepted = {s: (r + s) % n for s, n in enumerate(lengths) if n > 1}
        eager_cache = copy.deepcopy(cache)
        eager = model.forward(batch, eager_cache, layers=(0,))  # a DFlash2 drafter's layer outputs too
        model.commit_verify(batch, eager_cache, accepted)
        assert graphs.fits(batch, (0,))
        assert graphs.fits(batch, (1,)) == (r == 0)  # once a set of layers has graphs, another set runs eagerly
        replay = graphs.run(batch, (0,))
        model.commit_verify(batch, cache, accepted)
        assert torch.equal(eager.logits, replay.logits), f"round {r}: logits"
        assert torch.equal(eager.layers, replay.layers), f"round {r}: layer 0's outputs"
        live = slice(0, cache.num_slots)  # the scratch slot after them holds what the graph's padding left
        for layer in cache.kda_state:
            for name in ("kda_state", "conv_state"):
                want, got = getattr(eager_cache, name)[layer][live], getattr(cache, name)[layer][live]
                assert torch.equal(want, got), f"round {r}: {name} {layer}"
        ends = [e + accepted.get(s, 0) + 1 for s, e in enumerate(ends)]
    assert len([k for k in graphs.graphs if k[3]]) == 1  # 10, 12 and 9 rows: one graph (16 rows, 8 sequences)
