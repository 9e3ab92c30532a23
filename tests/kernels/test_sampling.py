"""Tests for kernels.sampling: keyed, exact, batch-independent sampling."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from kernels import sampling as S
from kernels.sampling import (
    SamplingParams,
    filter_logits,
    gumbel_noise,
    keyed_hash32,
    sample,
    token_logprobs,
)

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """Plain-Python MurmurHash3_x86_32 for messages of whole 4-byte blocks."""
    assert len(data) % 4 == 0
    m = 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & m

    h = seed
    for (k,) in struct.iter_unpack("<I", data):
        k = (k * 0xCC9E2D51) & m
        k = rotl(k, 15)
        k = (k * 0x1B873593) & m
        h = rotl(h ^ k, 13)
        h = (h * 5 + 0xE6546B64) & m
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def _key(seed: int, position: int, token: int) -> bytes:
    return struct.pack("<QQI", seed % 2**64, position % 2**64, token)


def _params(rows: list[tuple[float, int, float, float, int]], device: str = "cpu") -> SamplingParams:
    """rows of (temperature, top_k, top_p, min_p, seed)."""
    t, k, p, m, s = zip(*rows)
    return SamplingParams.from_lists(list(t), list(k), list(p), list(m), list(s), device)


def _random_row(gen: torch.Generator, vocab: int) -> tuple[float, int, float, float, int]:
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    return (
        pick([0.0, 0.0, 0.5, 1.0, 1.3]),
        pick([0, 0, 1, 7, 50, vocab, vocab + 10]),
        pick([1.0, 1.0, 0.9, 0.5, 0.01]),
        pick([0.0, 0.0, 0.05, 0.3]),
        int(torch.randint(-(2**62), 2**62, (1,), generator=gen)) * 2 + 1,
    )


def _exact_logits(rows: int, vocab: int) -> torch.Tensor:
    """Logits from integer arithmetic only, so golden tests don't depend on an RNG."""
    r = torch.arange(rows, dtype=torch.int64)[:, None]
    i = torch.arange(vocab, dtype=torch.int64)[None, :]
    return ((i * 7919 + r * 104729) % 10007).to(torch.float32) / 1000.0


# ---------------------------------------------------------------------------
# the hash
# ---------------------------------------------------------------------------


def test_reference_murmur3_matches_known_vectors():
    assert _murmur3_x86_32(b"test") == 0xBA6BD213
    assert _murmur3_x86_32(b"abcdefgh") == 0x49DDCCC4
    assert _murmur3_x86_32(b"twinspark-sampling!!") == 0xF3AC79A9


def test_hash_matches_reference_in_range_and_nonnegative():
    gen = torch.Generator().manual_seed(0)
    seeds = [0, 1, -1, 2**63 - 1, -(2**63)] + torch.randint(-(2**63), 2**63 - 1, (11,), generator=gen).tolist()
    positions = [0, 1, 2**32 - 1, 2**32, 2**62] + torch.randint(0, 2**40, (11,), generator=gen).tolist()
    vocab = 257
    h = keyed_hash32(torch.tensor(seeds), torch.tensor(positions), vocab)
    assert h.dtype == torch.int64 and h.shape == (16, vocab)
    assert int(h.min()) >= 0 and int(h.max()) < 2**32
    for r, (s, p) in enumerate(zip(seeds, positions)):
        for t in (0, 1, 2, 100, 255, 256):
            assert int(h[r, t]) == _murmur3_x86_32(_key(s, p, t)), (s, p, t)


# Changing any of these changes every seeded reply ever given: don't, or
# change them knowingly (and say so in the release notes).
GOLDEN_HASH = [
    ((0, 0, 0), 0xEE9D294A),
    ((0, 0, 1), 0x7743FE48),
    ((42, 7, 12345), 0x22A848FF),
    ((-1, 2**40 + 3, 151000), 0x094D04D2),
    ((2**63 - 1, 123456789, 99), 0x50A2A724),
    ((-(2**63), 1, 2), 0x4830F496),
]
GOLDEN_NOISE = [
    ((0, 0, 0), "0x1.53c83ap+1"),
    ((0, 0, 1), "0x1.13e21ap-2"),
    ((42, 7, 12345), "-0x1.62ce6p-1"),
    ((-1, 2**40 + 3, 151000), "-0x1.32cf86p+0"),
    ((2**63 - 1, 123456789, 99), "-0x1.278b14p-3"),
    ((-(2**63), 1, 2), "-0x1.e2d154p-3"),
]


@pytest.mark.parametrize("key,value", GOLDEN_HASH)
def test_hash_golden_values(key, value):
    seed, position, token = key
    h = keyed_hash32(torch.tensor([seed]), torch.tensor([position]), token + 1)
    assert int(h[0, token]) == value
    assert _murmur3_x86_32(_key(seed, position, token)) == value


@pytest.mark.parametrize("key,value", GOLDEN_NOISE)
def test_noise_golden_values(key, value):
    seed, position, token = key
    g = gumbel_noise(torch.tensor([seed]), torch.tensor([position]), token + 1)
    assert g.dtype == torch.float32
    assert float(g[0, token]) == float.fromhex(value)
    # and it is the Gumbel transform of that hash
    u = (dict(GOLDEN_HASH)[key] + 0.5) / 2**32
    assert float(g[0, token]) == pytest.approx(-math.log(-math.log(u)), rel=1e-6, abs=1e-6)


def test_uint64_and_negative_seed_are_the_same_bits():
    a = SamplingParams.from_lists([1.0], [0], [1.0], [0.0], [2**64 - 5], "cpu")
    b = SamplingParams.from_lists([1.0], [0], [1.0], [0.0], [-5], "cpu")
    assert torch.equal(a.seed, b.seed)
    with pytest.raises(ValueError):
        SamplingParams.from_lists([1.0], [0], [1.0], [0.0], [2**64], "cpu")


# ---------------------------------------------------------------------------
# noise and the exact float helpers
# ---------------------------------------------------------------------------


def test_log_exp_helpers_are_accurate():
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(100_000, dtype=torch.float64, generator=gen) * torch.exp(
        torch.randn(100_000, dtype=torch.float64, generator=gen) * 20
    )
    torch.testing.assert_close(S._log64(x), torch.log(x), rtol=1e-13, atol=1e-14)
    assert float(S._log64(torch.tensor([1.0], dtype=torch.float64))) == 0.0
    y = -torch.rand(100_000, dtype=torch.float64, generator=gen) * 60
    torch.testing.assert_close(S._exp64(y), torch.exp(y), rtol=1e-14, atol=0)


def test_noise_is_gumbel_and_blocking_never_changes_it(monkeypatch):
    seed = torch.tensor([3, -7])
    pos = torch.tensor([11, 2**33])
    g = gumbel_noise(seed, pos, 100_000)
    assert torch.isfinite(g).all()
    assert -3.2 < float(g.min()) and float(g.max()) < 23.0
    assert float(g.mean()) == pytest.approx(0.5772156649, abs=0.02)  # Euler-Mascheroni
    assert float(g.var()) == pytest.approx(math.pi**2 / 6, abs=0.05)
    small = gumbel_noise(seed, pos, 3000)
    assert torch.equal(small, g[:, :3000])  # a token's noise doesn't depend on the vocab size
    for block in (1, 7, 1000, 1 << 30):
        monkeypatch.setitem(S._NOISE_BLOCK, "cpu", block)
        assert torch.equal(gumbel_noise(seed, pos, 3000), small), block


# ---------------------------------------------------------------------------
# greedy
# ---------------------------------------------------------------------------


def test_greedy_is_argmax_with_ties_to_lowest_id():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 300, generator=gen)
    logits[1, [5, 17, 200]] = 50.0  # tie at the max
    logits[2] = 0.0  # all equal
    logits[3, [299, 0]] = 9.0
    ids = sample(logits, torch.arange(6), SamplingParams.greedy(6, "cpu"))
    expected = logits.argmax(dim=-1)
    assert torch.equal(ids, expected)
    assert ids[1] == 5 and ids[2] == 0 and ids[3] == 0


def test_greedy_ignores_filters_and_seed():
    logits = _exact_logits(4, 500)
    p = _params([(0.0, 3, 0.2, 0.5, 99)] * 4)
    assert torch.equal(sample(logits, torch.arange(4), p), logits.argmax(dim=-1))


# ---------------------------------------------------------------------------
# determinism and batch independence
# ---------------------------------------------------------------------------


def test_same_inputs_same_tokens():
    logits = _exact_logits(8, 1000)
    pos = torch.arange(8) * 13
    p = _params([(1.0, 0, 1.0, 0.0, 5), (0.7, 40, 0.9, 0.0, -5), (1.2, 0, 0.8, 0.1, 2**62)] + [(1.0, 0, 1.0, 0.0, 1)] * 5)
    first = sample(logits, pos, p)
    for _ in range(3):
        assert torch.equal(sample(logits, pos, p), first)


def test_row_token_independent_of_batch():
    gen = torch.Generator().manual_seed(3)
    vocab = 2048
    probes = [(1.0, 0, 1.0, 0.0, 7), (0.8, 50, 1.0, 0.0, -9), (1.0, 0, 0.9, 0.0, 11),
              (0.6, 0, 1.0, 0.05, 2**61), (1.3, 20, 0.7, 0.1, -(2**63)), (0.0, 0, 1.0, 0.0, 0)]
    probe_logits = torch.randn(len(probes), vocab, generator=gen) * 3
    probe_pos = torch.randint(0, 10_000, (len(probes),), generator=gen)
    alone = [
        int(sample(probe_logits[i : i + 1], probe_pos[i : i + 1], _params([probes[i]]))) for i in range(len(probes))
    ]
    for trial in range(12):
        others = int(torch.randint(1, 17, (1,), generator=gen))
        rows = [_random_row(gen, vocab) for _ in range(others)]
        logits = torch.cat([torch.randn(others, vocab, generator=gen) * 3, probe_logits])
        pos = torch.cat([torch.randint(0, 10_000, (others,), generator=gen), probe_pos])
        order = torch.randperm(others + len(probes), generator=gen)
        all_rows = rows + probes
        ids = sample(logits[order], pos[order], _params([all_rows[j] for j in order.tolist()]))
        for slot, j in enumerate(order.tolist()):
            if j >= others:
                assert int(ids[slot]) == alone[j - others], (trial, j)


def test_seeds_and_positions_spread_tokens():
    vocab = 1000
    flat = torch.zeros(200, vocab)
    by_position = sample(flat, torch.arange(200), _params([(1.0, 0, 1.0, 0.0, 1234)] * 200))
    by_seed = sample(flat, torch.full((200,), 77), _params([(1.0, 0, 1.0, 0.0, s) for s in range(200)]))
    # 200 uniform draws from 1000 tokens: ~181 distinct expected
    assert len(set(by_position.tolist())) > 160
    assert len(set(by_seed.tolist())) > 160
    assert (by_position != by_seed).float().mean() > 0.9


# ---------------------------------------------------------------------------
# distribution
# ---------------------------------------------------------------------------

LOGITS5 = torch.tensor([1.0, 2.0, 0.5, -1.0, 1.5])
DRAWS = 20_000


def _frequencies(params_row, logits=LOGITS5) -> torch.Tensor:
    logits = logits.expand(DRAWS, -1)
    seeds = (torch.arange(DRAWS) % 97).tolist()
    ids = sample(logits, torch.arange(DRAWS) // 97, _params([params_row[:4] + (s,) for s in seeds]))
    return torch.bincount(ids, minlength=logits.shape[1]).double() / DRAWS


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_frequencies_match_softmax(temperature):
    freq = _frequencies((temperature, 0, 1.0, 0.0))
    probs = torch.softmax(LOGITS5.double() / temperature, dim=-1)
    assert float((freq - probs).abs().max()) < 0.02
    chi2 = float(((freq - probs) ** 2 / probs).sum() * DRAWS)
    assert chi2 < 20.5  # 4 degrees of freedom, p ~ 0.0004


def test_filtered_frequencies_match_renormalised_softmax():
    # top_k=3 keeps ids {1, 4, 0}; top_p=0.6 then keeps the prefix reaching 0.6
    probs = torch.softmax(LOGITS5.double(), dim=-1)
    freq = _frequencies((1.0, 3, 1.0, 0.0))
    want = torch.zeros(5, dtype=torch.float64)
    want[[1, 4, 0]] = probs[[1, 4, 0]] / probs[[1, 4, 0]].sum()
    assert float((freq - want).abs().max()) < 0.02
    freq = _frequencies((1.0, 0, 1.0, 0.5))  # min_p: keep p >= 0.5 * p_max -> ids 1 (max), 4
    want = torch.zeros(5, dtype=torch.float64)
    want[[1, 4]] = probs[[1, 4]] / probs[[1, 4]].sum()
    assert float((freq - want).abs().max()) < 0.02


# ---------------------------------------------------------------------------
# filters
# ---------------------------------------------------------------------------


def test_degenerate_filters_equal_greedy():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 3000, generator=gen) * 2
    pos = torch.arange(64)
    greedy = logits.argmax(dim=-1)
    for row in [(1.0, 1, 1.0, 0.0), (1.7, 0, 1e-6, 0.0), (0.9, 0, 0.0, 0.0), (1.0, 0, 1.0, 1.0)]:
        p = _params([row + (s,) for s in range(64)])
        assert torch.equal(sample(logits, pos, p), greedy), row


def test_top_k_keeps_exactly_k_with_ties_to_lowest_id():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0, 3.0, 3.0, -1.0]] * 4)
    p = _params([(1.0, 1, 1.0, 0.0, 0), (1.0, 2, 1.0, 0.0, 0), (1.0, 5, 1.0, 0.0, 0), (1.0, 0, 1.0, 0.0, 0)])
    kept = torch.isfinite(filter_logits(logits, p))
    assert kept[0].nonzero().flatten().tolist() == [1]
    assert kept[1].nonzero().flatten().tolist() == [1, 3]
    assert kept[2].nonzero().flatten().tolist() == [1, 3, 4, 5, 6]
    assert bool(kept[3].all())


def test_sampled_tokens_stay_in_top_k():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 5000, generator=gen).expand(500, -1)
    k = 10
    allowed = set(torch.topk(logits[0], k).indices.tolist())
    ids = sample(logits, torch.arange(500), _params([(2.0, k, 1.0, 0.0, 9)] * 500))
    assert set(ids.tolist()) <= allowed
    assert len(set(ids.tolist())) == k  # T=2 spreads draws over all of them


def _reference_keep(z: torch.Tensor, top_p: float, min_p: float) -> torch.Tensor:
    """Straightforward float64 top-p then min-p on one row of scaled logits."""
    probs = torch.softmax(z.double(), dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_p < 1.0:
        p_sorted, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(p_sorted, 0) - p_sorted
        keep = torch.zeros_like(keep).scatter_(0, order, before < top_p)
        keep[order[0]] = True
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
    return keep


def test_top_p_and_min_p_match_float64_reference():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(24, 4000, generator=gen) * 2.5
    rows = [(t, 0, p, m, 0) for t in (0.7, 1.0, 1.5) for p, m in ((0.5, 0.0), (0.9, 0.0), (0.99, 0.0), (1.0, 0.02),
                                                                  (1.0, 0.2), (0.9, 0.01), (0.3, 0.5), (0.95, 0.001))]
    z = filter_logits(logits, _params(rows))
    for r, (t, _, p, m, _) in enumerate(rows):
        want = _reference_keep(logits[r] / t, p, m)
        assert torch.equal(torch.isfinite(z[r]), want), rows[r]
        assert torch.equal(z[r][want], (logits[r] / t)[want])


def test_top_p_small_prefix_example():
    logits = torch.log(torch.tensor([[0.5, 0.05, 0.3, 0.15]] * 3))
    p = _params([(1.0, 0, 0.79, 0.0, 0), (1.0, 0, 0.81, 0.0, 0), (1.0, 0, 0.4, 0.0, 0)])
    kept = torch.isfinite(filter_logits(logits, p))
    assert kept.tolist() == [[True, False, True, False], [True, False, True, True], [True, False, False, False]]


# ---------------------------------------------------------------------------
# golden end-to-end ids (the whole pipeline, not just the hash)
# ---------------------------------------------------------------------------

GOLDEN_ROWS = [
    (0.0, 0, 1.0, 0.0, 0),
    (1.0, 0, 1.0, 0.0, 0),
    (1.0, 0, 1.0, 0.0, 1),
    (0.7, 40, 1.0, 0.0, -3),
    (1.0, 0, 0.9, 0.0, 2**63 - 1),
    (1.5, 0, 1.0, 0.05, 12345),
    (0.9, 100, 0.95, 0.01, -(2**63)),
    (2.0, 0, 1.0, 0.0, 2**40),
]
GOLDEN_IDS = [1040, 3290, 1971, 4114, 4658, 1321, 1480, 2115]


def test_golden_sample_ids():
    logits = _exact_logits(len(GOLDEN_ROWS), 5000)
    ids = sample(logits, torch.arange(len(GOLDEN_ROWS)) * 1000 + 17, _params(GOLDEN_ROWS))
    assert ids.tolist() == GOLDEN_IDS


# ---------------------------------------------------------------------------
# logprobs
# ---------------------------------------------------------------------------


def test_token_logprobs_match_log_softmax():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 1000, generator=gen) * 3
    logits[2, [10, 20, 30, 40]] = 20.0  # ties inside the top k
    logits[3, [999, 998, 5]] = 20.0
    ids = torch.tensor([0, 1, 20, 999, 500])
    chosen, top_ids, top_lp = token_logprobs(logits, ids, 3)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(chosen, ref.gather(1, ids[:, None]).squeeze(1))
    torch.testing.assert_close(top_lp, ref.gather(1, top_ids))
    torch.testing.assert_close(top_lp, torch.topk(ref, 3).values)
    assert top_ids[2].tolist() == [10, 20, 30]
    assert top_ids[3].tolist() == [5, 998, 999]
    assert bool((top_lp[:, :-1] >= top_lp[:, 1:]).all())
    c0, i0, l0 = token_logprobs(logits, ids, 0)
    assert i0.shape == (5, 0) and l0.shape == (5, 0)


def test_bitmask_forbids_tokens_and_sampling_respects_it():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 70, generator=g)
    words = torch.zeros(1, 3, dtype=torch.int32)
    words[0, 0] = 1 << 5            # token 5
    words[0, 2] = (1 << 1) | (1 << 3)  # tokens 65, 67
    masked = S.apply_token_bitmask(logits, words, torch.tensor([0, -1, 0]))
    assert torch.equal(masked[1], logits[1])
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [5, 65, 67]
    params = SamplingParams.from_lists([0.0, 0.9, 1.3], [0, 0, 0], [1.0, 1.0, 0.9], [0.0] * 3, [1, 2, 3], "cpu")
    ids = sample(masked, torch.tensor([4, 4, 4]), params).tolist()
    assert ids[0] in (5, 65, 67) and ids[2] in (5, 65, 67)


def test_processed_logprobs_are_the_sampled_distribution():
    """log-softmax of logits / T after the filters, against a float64 reference, to 1e-5."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 300, generator=g) * 3
    params = SamplingParams.from_lists([0.0, 0.7, 1.0, 1.5], [0, 20, 0, 0], [1.0, 1.0, 0.8, 1.0],
                                       [0.0, 0.0, 0.0, 0.05], [1, 2, 3, 4], "cpu")
    ids = sample(logits, torch.tensor([9, 9, 9, 9]), params)
    chosen, top_ids, top_lp = S.processed_logprobs(logits, params, ids, 5)
    z = S.filter_logits(logits, params).double()
    ref = torch.log_softmax(z, dim=-1)
    assert torch.allclose(chosen.double(), ref.gather(1, ids[:, None]).squeeze(1), atol=1e-5)
    assert torch.allclose(top_lp.double(), ref.gather(1, top_ids), atol=1e-5)
    assert bool((top_lp[:, :-1] >= top_lp[:, 1:]).all())
    # Greedy row: T = 1 with no filters is the raw log-softmax.
    raw = torch.log_softmax(logits[0].double(), dim=-1)
    assert abs(float(chosen[0]) - float(raw[ids[0]])) < 1e-5 and int(ids[0]) == int(raw.argmax())


def test_prompt_logprobs_are_the_raw_log_softmax_bit_for_bit(monkeypatch):
    """Prompt logprobs: torch.log_softmax of the fp32 logits itself, bit for bit (alone, in any block of rows), the
    rank as vLLM counts it (ids with a logprob >= the token's) and the top k with ties by lowest id."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(37, 1088, generator=g) * 4
    logits[3, 17] = logits[3, 18] = logits[3].max() + 1  # a tie at the top
    nxt = torch.randint(0, 1088, (37,), generator=g)
    nxt[3] = 18
    ref = torch.log_softmax(logits, dim=-1)
    monkeypatch.setattr(S, "_SCORE_BLOCK", 8)  # several blocks, the last one short
    chosen, ranks, top_ids, top_lp = S.prompt_logprobs(logits, nxt, 4)
    assert torch.equal(chosen, ref.gather(1, nxt[:, None]).squeeze(1))
    assert torch.equal(ranks, (ref >= chosen[:, None]).sum(-1))
    assert int(ranks[3]) == 2 and top_ids[3, :2].tolist() == [17, 18]
    assert torch.equal(top_lp, ref.gather(1, top_ids)) and bool((top_lp[:, :-1] >= top_lp[:, 1:]).all())
    for r in (0, 3, 36):  # a row alone has the same bits as among the others
        alone = S.prompt_logprobs(logits[r : r + 1], nxt[r : r + 1], 4)
        assert torch.equal(alone[0], chosen[r : r + 1]) and torch.equal(alone[3], top_lp[r : r + 1])
    none = S.prompt_logprobs(logits[:0], nxt[:0], 2)
    assert none[0].shape == (0,) and none[2].shape == (0, 2)


def test_noise_drawn_for_the_finite_tokens_only_picks_what_the_whole_draw_picks() -> None:
    """On the CPU a row left with few tokens (a grammar's mask, top-k) gets noise only where a token can win: the
    same ids as the noise over the whole vocabulary, rows with one token and with none left included."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 5000, generator=g)
    z[torch.rand(6, 5000, generator=g) > 0.02] = float("-inf")
    z[3] = float("-inf")
    z[4, 1:] = float("-inf")
    seed, position = torch.arange(6) * 7 + 1, torch.arange(6) + 100
    whole = (z + S.gumbel_noise(seed, position, 5000)).argmax(dim=-1)
    assert int(torch.isfinite(z).sum()) < S._SPARSE_SHARE * z.numel()  # the sparse path runs
    assert torch.equal(S.noisy_argmax(z, seed, position), whole)
