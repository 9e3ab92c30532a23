"""Verify windows (drafts): a drafted generation is token-identical and logit-bit-identical to the same generation
without drafts, greedy and seeded sampling, with windows batched next to plain decode rows and prefill chunks.

Plain run: every sequence alone, one decode row per step. Drafted run: all sequences in one packed batch per round;
each round a sequence is a verify window [last token, d_1..d_k] whose drafts are the plain run's future tokens with
some deliberately wrong (so windows are accepted fully, partly and not at all), or a plain decode row."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.sampling import SamplingParams, sample
from model.batch import Batch
from model.model import accept_drafts
from tests.model.reference import fresh_cache, our_model, random_ids, run_chunks, table

CAP = 96
GEN = 24
PROMPTS = [19, 26, 33]


def _params(n: int, temperature: float, seed: int) -> SamplingParams:
    return SamplingParams(temperature=torch.full((n,), temperature), top_k=torch.zeros(n, dtype=torch.long),
                          top_p=torch.ones(n), min_p=torch.zeros(n), seed=torch.full((n,), seed, dtype=torch.long))


def _plain(model, prompt: list[int], temperature: float, seed: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy/seeded generation one row at a time: the generated tokens and the logits that chose each."""
    cache = fresh_cache(model, CAP, slots=1)
    logits = run_chunks(model, cache, prompt, [len(prompt)], capacity=CAP)[-1:]
    toks, rows = [], []
    for _ in range(GEN):
        pos = len(prompt) + len(toks)
        tok = int(sample(logits, torch.tensor([pos]), _params(1, temperature, seed))[0])
        toks.append(tok)
        rows.append(logits[0])
        if len(toks) == GEN:
            break
        logits = model.forward(Batch.single([tok], pos, table(0, CAP), all_logits=True), cache).logits
    return toks, rows


def _drafted(model, prompts, truth, temperature: float, seed: int, rng: random.Random, k: int = 4):
    """All sequences together; returns per sequence (tokens, logits per token, drafted, accepted)."""
    n = len(prompts)
    cache = fresh_cache(model, CAP, slots=n)
    toks: list[list[int]] = [[] for _ in range(n)]
    rows: list[list[torch.Tensor]] = [[] for _ in range(n)]
    drafted, accepted = [0] * n, [0] * n
    last_logits = []
    for s, p in enumerate(prompts):
        last_logits.append(run_chunks(model, cache, p, [len(p)], slot=s, capacity=CAP)[-1])
    for s in range(n):  # the first token comes from the prefill's last row
        pos = len(prompts[s])
        toks[s].append(int(sample(last_logits[s][None], torch.tensor([pos]), _params(1, temperature, seed))[0]))
        rows[s].append(last_logits[s])
    while any(len(t) < GEN for t in toks):
        live = [s for s in range(n) if len(toks[s]) < GEN]
        windows, verify = {}, []
        for s in live:
            done = len(toks[s])
            future = truth[s][done : done + min(k, GEN - done - 1)]
            mode = rng.random()
            if mode < 0.2:
                drafts = []  # a plain decode row
            else:
                drafts = list(future)
                if drafts and mode < 0.6:
                    cut = rng.randrange(len(drafts))
                    drafts[cut] = (drafts[cut] + 1) % 500  # wrong from here on
            windows[s] = [toks[s][-1]] + drafts
            verify.append(bool(drafts))
        ids = sum((windows[s] for s in live), [])
        batch = Batch(token_ids=torch.tensor(ids), starts=[len(prompts[s]) + len(toks[s]) - 1 for s in live],
                      lengths=[len(windows[s]) for s in live],
                      block_tables=torch.tensor([table(s, CAP) for s in live]), slots=live,
                      logit_rows=torch.arange(len(ids)), verify=verify)
        logits = model.forward(batch, cache).logits
        sampled = sample(logits, batch.positions + 1, _params(len(ids), temperature, seed)).tolist()
        acc = {}
        for i, (s, off) in enumerate(zip(live, batch.offsets)):
            w = windows[s]
            a = accept_drafts(w, sampled[off : off + len(w)])
            acc[i] = a
            drafted[s] += len(w) - 1
            accepted[s] += a
            for r in range(a + 1):  # the accepted drafts' rows plus the bonus row
                toks[s].append(sampled[off + r])
                rows[s].append(logits[off + r])
        model.commit_verify(batch, cache, {i: a for i, a in acc.items() if verify[i]})
    return [(toks[s][:GEN], rows[s][:GEN], drafted[s], accepted[s]) for s in range(n)]


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.8, 1234)])
def test_drafted_equals_plain(tiny_sparse, temperature, seed):
    model = our_model(tiny_sparse)
    prompts = [random_ids(n, seed=300 + n) for n in PROMPTS]
    plain = [_plain(model, p, temperature, seed) for p in prompts]
    truth = [t for t, _ in plain]
    out = _drafted(model, prompts, truth, temperature, seed, random.Random(seed))
    for s, ((ptoks, prows), (dtoks, drows, drafted, accepted)) in enumerate(zip(plain, out)):
        print(f"T={temperature} seq {s}: drafted {drafted}, accepted {accepted}")
        assert dtoks == ptoks
        for i, (a, b) in enumerate(zip(prows, drows)):
            assert torch.equal(a, b), f"seq {s} token {i}: logits differ by {(a - b).abs().max().item():.3e}"
    assert sum(o[3] for o in out) > 0 and sum(o[2] for o in out) > sum(o[3] for o in out)
