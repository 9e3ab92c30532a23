"""Our runtime against transformers' `glm5_next` (fp32, CPU): prefill, chunked prefill + decode, packed batches,
greedy generation. Two checkpoints: DSA selecting far fewer tokens than the prompt (`tiny_sparse`), and a shared
indexer layer (`tiny_shared`)."""

from __future__ import annotations

import pytest
import torch

from model.batch import Batch
from tests.model.reference import (cache_tensors, clone_cache, fresh_cache, hf_logits, hf_model, our_model,
                                   random_ids, run_chunks, table)

TOL = 1e-4
LONG = 210  # prompt length of the long cases (>= 200)
DECODE = 32


@pytest.fixture(params=["tiny_sparse", "tiny_shared"])
def ckpt(request):
    return request.getfixturevalue(request.param)


@pytest.fixture
def long_case(ckpt):
    """One 242-token sequence and transformers' logits for all of it (computed once per checkpoint)."""
    ids = random_ids(LONG + DECODE, seed=7)
    return ids, hf_logits(ckpt, ids)


@pytest.mark.parametrize("n", [1, 17, 64])
def test_prefill_short(ckpt, n):
    ids = random_ids(n, seed=n)
    model = our_model(ckpt)
    ours = run_chunks(model, fresh_cache(model, n), ids, [n])
    delta = (ours - hf_logits(ckpt, ids)).abs().max().item()
    print(f"prefill {n}: max |dlogits| = {delta:.2e}")
    assert delta <= TOL


def test_prefill_long(ckpt, long_case):
    ids, ref = long_case
    model = our_model(ckpt)
    ours = run_chunks(model, fresh_cache(model, len(ids)), ids, [len(ids)])
    delta = (ours - ref).abs().max().item()
    print(f"prefill {len(ids)}: max |dlogits| = {delta:.2e}")
    assert delta <= TOL


@pytest.mark.parametrize("chunks", [[7, 64, 100, 39], [LONG], [1, 2, 3, 50, 154], [64, 64, 64, 18]])
def test_chunked_prefill_then_decode(ckpt, long_case, chunks):
    """Prefill 210 tokens in chunks, then 32 single-token decode steps; every row's logits vs one full forward."""
    ids, ref = long_case
    assert sum(chunks) == LONG
    model = our_model(ckpt)
    ours = run_chunks(model, fresh_cache(model, len(ids)), ids, chunks)
    delta = (ours - ref).abs().max().item()
    print(f"chunks {chunks} + {DECODE} decode: max |dlogits| = {delta:.2e}")
    assert delta <= TOL


def test_packed_batch_equals_each_alone(ckpt):
    """Three sequences at different stages in one forward (a fresh prefill chunk, a continued chunk, a decode row)
    give the same logits as each run alone — bit for bit — and match transformers."""
    model = our_model(ckpt)
    seqs = {0: random_ids(30, 1), 1: random_ids(52, 2), 2: random_ids(51, 3)}
    done = {0: 0, 1: 40, 2: 50}  # tokens already in the cache before the packed step
    cache = fresh_cache(model, 64)
    for s in (1, 2):
        run_chunks(model, cache, seqs[s][: done[s]], [done[s]], slot=s, capacity=64)
    alone_cache = clone_cache(cache)

    rows = [seqs[s][done[s]:] for s in range(3)]
    packed = Batch(token_ids=torch.tensor(sum(rows, [])), starts=[done[s] for s in range(3)],
                   lengths=[len(r) for r in rows], block_tables=torch.tensor([table(s, 64) for s in range(3)]),
                   slots=[0, 1, 2], logit_rows=torch.arange(sum(len(r) for r in rows)))
    together = model.forward(packed, cache).logits.split([len(r) for r in rows])
    for s in range(3):
        alone = model.forward(Batch.single(rows[s], done[s], table(s, 64), slot=s, all_logits=True), alone_cache).logits
        assert torch.equal(alone, together[s]), f"sequence {s} changed when batched"
        ref = hf_logits(ckpt, seqs[s])[done[s]:]
        assert (together[s] - ref).abs().max().item() <= TOL
    # The caches the two paths left behind are identical too (the next step would not diverge).
    alone_tensors = cache_tensors(alone_cache)
    for name, t in cache_tensors(cache).items():
        assert torch.equal(t, alone_tensors[name]), f"{name} differs"


def test_greedy_generation_matches_transformers(ckpt):
    from services.rank_worker.offline import GenerateRequest, generate_on_model

    prompt = random_ids(20, seed=11)
    ours = generate_on_model(our_model(ckpt), GenerateRequest(prompt_ids=tuple(prompt), max_tokens=64, ignore_eos=True))
    hf = hf_model(ckpt)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    theirs = out[0, len(prompt):].tolist()
    assert ours == theirs
