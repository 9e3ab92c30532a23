"""Tests for kernels.penalties against a plain per-token loop, and row independence (a row alone = in any batch)."""

from __future__ import annotations

import random

import torch

from kernels.penalties import Penalties, apply_penalties
from kernels.sampling import SamplingParams, processed_logprobs, sample

VOCAB = 97


def _row(rng: random.Random) -> dict:
    """One row's settings, each step on or off at random."""
    seen = rng.sample(range(VOCAB), rng.randrange(0, 12))
    bias = rng.sample(range(VOCAB), rng.randrange(0, 5))
    return {
        "presence": rng.choice([0.0, 0.5, -1.25, 2.0]),
        "frequency": rng.choice([0.0, 0.3, -2.0]),
        "repetition": rng.choice([1.0, 1.3, 0.7]),
        "seen": {t: rng.choice([0, 1, 3]) for t in seen},  # count 0: only in the prompt
        "bias": {t: rng.uniform(-100, 100) for t in bias},
        "banned": rng.sample(range(VOCAB), rng.randrange(0, 3)),
    }


def _reference(logits: list[float], row: dict) -> list[float]:
    """The rules of the module docstring, one token at a time, in float32 like the kernel."""
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731 — round each step as the kernel does
    out = []
    for t, z in enumerate(logits):
        z = f32(z)
        if t in row["bias"]:
            z = z + f32(row["bias"][t])
        if t in row["banned"]:
            z = f32(float("-inf"))
        if t in row["seen"]:
            r = f32(row["repetition"])
            z = z / r if z > 0 else z * r
            c = row["seen"][t]
            if c > 0:
                z = (z - f32(row["frequency"]) * f32(float(c))) - f32(row["presence"])
        out.append(float(z))
    return out


def _pack(rows: list[int], settings: list[dict]) -> Penalties:
    def padded(lists, dtype, fill):
        width = max((len(x) for x in lists), default=0)
        return torch.tensor([list(x) + [fill] * (width - len(x)) for x in lists], dtype=dtype).view(len(lists), width)

    return Penalties(
        rows=torch.tensor(rows, dtype=torch.int64),
        presence=torch.tensor([s["presence"] for s in settings], dtype=torch.float32),
        frequency=torch.tensor([s["frequency"] for s in settings], dtype=torch.float32),
        repetition=torch.tensor([s["repetition"] for s in settings], dtype=torch.float32),
        seen_ids=padded([list(s["seen"]) for s in settings], torch.int64, -1),
        seen_counts=padded([list(s["seen"].values()) for s in settings], torch.int64, 0),
        bias_ids=padded([list(s["bias"]) for s in settings], torch.int64, -1),
        bias_values=padded([list(s["bias"].values()) for s in settings], torch.float32, 0.0),
        banned_ids=padded([s["banned"] for s in settings], torch.int64, -1),
    )


def test_matches_the_plain_loop_reference():
    rng = random.Random(7)
    logits = torch.randn(40, VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    logits[0, :5] = torch.tensor([0.0, -0.0, 1e-30, float("-inf"), 3.0])  # zero, signed zero, tiny, masked
    settings = [_row(rng) for _ in range(40)]
    settings[0]["seen"] = {0: 2, 1: 1, 2: 0, 3: 5, 4: 1}
    got = apply_penalties(logits, _pack(list(range(40)), settings))
    for r in range(40):
        want = torch.tensor(_reference(logits[r].tolist(), settings[r]), dtype=torch.float32)
        assert torch.equal(got[r], want), r


def test_rows_without_penalties_are_untouched_bit_for_bit():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(4))
    logits[2, 7] = -0.0
    rng = random.Random(1)
    got = apply_penalties(logits, _pack([1, 4], [_row(rng), _row(rng)]))
    for r in (0, 2, 3, 5):
        assert torch.equal(got[r].view(torch.int32), logits[r].view(torch.int32))
    assert apply_penalties(logits, None) is not None and torch.equal(apply_penalties(logits, None), logits)


def test_a_row_alone_equals_the_row_in_a_batch():
    """Row invariance: a penalised row's logits, sample and logprobs are the same whatever shares the batch (plain
    rows, rows with wider id lists)."""
    rng = random.Random(11)
    n = 24
    logits = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    settings = [_row(rng) for _ in range(n)]
    penalised = [r for r in range(n) if r % 3]  # every third row plain
    batch = apply_penalties(logits, _pack(penalised, [settings[r] for r in penalised]))
    params = SamplingParams.from_lists([0.0 if r % 2 else 0.9 for r in range(n)], [0] * n, [1.0] * n, [0.0] * n,
                                       list(range(n)), "cpu")
    positions = torch.arange(n, dtype=torch.int64) + 100
    ids_batch = sample(batch, positions, params)
    lp_batch = processed_logprobs(batch, params, ids_batch, 3)
    for r in penalised:
        alone = apply_penalties(logits[r : r + 1], _pack([0], [settings[r]]))
        assert torch.equal(alone[0], batch[r])
        p1 = SamplingParams(*(t[r : r + 1] for t in (params.temperature, params.top_k, params.top_p, params.min_p,
                                                     params.seed)))
        one = sample(alone, positions[r : r + 1], p1)
        assert int(one) == int(ids_batch[r])
        lp1 = processed_logprobs(alone, p1, one, 3)
        assert all(torch.equal(a[0], b[r]) for a, b in zip(lp1, lp_batch))


def test_bias_and_ban_decide_greedy_picks():
    logits = torch.zeros(2, VOCAB)
    logits[:, 10] = 5.0
    settings = [{"presence": 0.0, "frequency": 0.0, "repetition": 1.0, "seen": {}, "bias": {42: 100.0},
                 "banned": []},
                {"presence": 0.0, "frequency": 0.0, "repetition": 1.0, "seen": {}, "bias": {}, "banned": [10]}]
    z = apply_penalties(logits, _pack([0, 1], settings))
    assert z.argmax(-1).tolist() == [42, 0] and z[1, 10] == float("-inf")
