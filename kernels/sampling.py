"""Keyed sampling: exact, batch-independent token choice.

The rule (design card): a row's token is

    argmax_i  filtered(logits / T)_i + gumbel(seed, position, i)      (ties -> lowest id)

and temperature 0 means plain argmax (greedy).  The Gumbel noise for token
``i`` is keyed by ``hash(seed, absolute position, i)``, so the draw depends on
nothing but the row's own logits, seed and position: not on which other rows
share the batch, not on speculative drafts, not on timing.  A retried or
replayed request gets the same reply, and a draft token can be verified by
recomputing the target's choice at that position.

Exactness across CPU and CUDA.  Every step uses only operations whose result
IEEE 754 (or plain integer arithmetic) fixes bit for bit:

* the hash is MurmurHash3_x86_32 computed with integer ops on 32-bit lanes held
  in int64 tensors (no product ever exceeds 2**63, so nothing relies on how
  torch wraps an overflow);
* logarithms and exponentials are computed here from ``+ - * /`` (each one a
  separate, correctly rounded elementwise kernel), ``frexp`` and bit
  manipulation, instead of ``torch.log``/``torch.exp``, whose last-bit results
  differ between CPU (Sleef/glibc) and CUDA (libdevice);
* the only reductions over the vocabulary whose order could matter (top-p's
  cumulative sum) run on integers, which are associative;
* comparisons, max, stable sort and argmax are exact.  ``torch.argmax``
  documents that it returns the first maximal index, which is the
  "ties -> lowest id" rule; ``torch.topk`` documents no tie order, so it is
  only used for *values* and ties are resolved here by id.

Every operation works along the vocabulary dimension of one row, and every row
runs the same sequence of operations (greedy and sampled rows alike; a filter
that is off for a row keeps everything), so a row's ids are bit-identical alone
or inside any batch.  Batch-level shortcuts (skip the sort when no row uses
top-p, skip top-k when no row uses it) only skip work whose result would be
"keep everything" for every row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from kernels.gpu import to_device
from kernels.sampling_rules import MIN_P, SAMPLER_TOP_P, SEED, TEMPERATURE, TOP_K

__all__ = [
    "SamplingParams",
    "keyed_hash32",
    "gumbel_noise",
    "filter_logits",
    "sample",
    "token_logprobs",
    "processed_logprobs",
    "prompt_logprobs",
    "apply_token_bitmask",
]

# ---------------------------------------------------------------------------
# The hash: MurmurHash3_x86_32 on 32-bit lanes held in int64 tensors.
#
# The key of token ``t`` at ``position`` for ``seed`` is the 20-byte
# little-endian message  seed (u64) | position (u64) | t (u32), hashed with
# MurmurHash3_x86_32 and hash seed 0, i.e. in Python:
#     mmh3.hash(struct.pack("<QQI", seed % 2**64, position % 2**64, t), 0, signed=False)
# Changing any of this changes every seeded reply; tests pin golden values.
# ---------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF
_C1 = 0xCC9E2D51
_C2 = 0x1B873593
_F1 = 0x85EBCA6B
_F2 = 0xC2B2AE35
_KEY_BYTES = 20  # 5 words: seed lo, seed hi, position lo, position hi, token id


def _mul32(a: Tensor, c: int) -> Tensor:
    """(a * c) mod 2**32 for 0 <= a < 2**32, exactly, without int64 overflow.

    Splitting the constant into 16-bit halves keeps each product below 2**48.
    """
    lo = a * (c & 0xFFFF)
    hi = ((a * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _rotl32(a: Tensor, r: int) -> Tensor:
    return ((a << r) | (a >> (32 - r))) & _MASK32


def _fmix32(h: Tensor) -> Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _F1)
    h = h ^ (h >> 13)
    h = _mul32(h, _F2)
    return h ^ (h >> 16)


def _scramble(k: Tensor) -> Tensor:
    """Murmur3's per-block key scramble (depends on the block only)."""
    return _mul32(_rotl32(_mul32(k, _C1), 15), _C2)


def _absorb(h: Tensor, scrambled_k: Tensor) -> Tensor:
    """Murmur3's per-block state update with an already scrambled block."""
    h = _rotl32(h ^ scrambled_k, 13)
    return (h * 5 + 0xE6546B64) & _MASK32


def _row_state(seed: Tensor, position: Tensor) -> Tensor:
    """Murmur3 state after the four row blocks (seed lo/hi, position lo/hi): [R]."""
    seed = seed.to(torch.int64)
    position = position.to(device=seed.device, dtype=torch.int64)
    # Two's complement bits: a negative seed is the uint64 with the same bits.
    words = (
        seed & _MASK32,
        (seed >> 32) & _MASK32,
        position & _MASK32,
        (position >> 32) & _MASK32,
    )
    h = torch.zeros_like(seed)  # murmur hash seed 0
    for w in words:
        h = _absorb(h, _scramble(w))
    return h


def _pair_hash(row_state: Tensor, tokens: Tensor) -> Tensor:
    """Absorb the token block and finalise, elementwise over broadcast row states and tokens: int64 in [0, 2**32)."""
    return _fmix32(_absorb(row_state, _scramble(tokens)) ^ _KEY_BYTES)


def _token_hash(row_state: Tensor, tokens: Tensor) -> Tensor:
    """Every row's hash of every token: int64 [R, len(tokens)] in [0, 2**32)."""
    return _pair_hash(row_state[:, None], tokens[None, :])


def keyed_hash32(seed: Tensor, position: Tensor, vocab: int) -> Tensor:
    """MurmurHash3_x86_32(seed | position | token) for every token: int64 [R, V].

    Values lie in [0, 2**32).  The four row blocks are hashed once per row;
    only the token block and the finaliser run on the [R, V] grid.
    """
    tokens = torch.arange(vocab, dtype=torch.int64, device=seed.device)
    return _token_hash(_row_state(seed, position), tokens)


# ---------------------------------------------------------------------------
# log and exp from correctly rounded basic operations (bit-identical anywhere).
# Accuracy is ~1e-15 relative, far beyond the float32 the results feed.
# ---------------------------------------------------------------------------

_LN2 = math.log(2.0)
_LN2_HI = 6.93147180369123816490e-01  # ln 2 split so that k * _LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10
_SQRT_HALF = math.sqrt(0.5)
_LOG_COEFFS = [1.0 / (2 * n + 1) for n in range(8)]  # atanh series: 1, 1/3, ... 1/15
_EXP_COEFFS = [1.0 / math.factorial(n) for n in range(15)]  # Taylor: 1, 1, 1/2, ... 1/14!


def _log64(x: Tensor) -> Tensor:
    """Natural log of positive finite float64 values.

    x = m * 2**e with m in [sqrt(1/2), sqrt(2)); log m = 2 atanh(s) with
    s = (m - 1) / (m + 1), |s| <= 0.172, summed to s**15 (relative tail < 2e-14).
    """
    m, e = torch.frexp(x)  # m in [0.5, 1)
    small = m < _SQRT_HALF
    m = torch.where(small, m * 2.0, m)  # exact
    e = e.to(torch.float64) - small.to(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    poly = torch.full_like(s, _LOG_COEFFS[-1])
    for c in reversed(_LOG_COEFFS[:-1]):
        poly = poly * s2 + c
    return (s * 2.0) * poly + e * _LN2


def _exp64(x: Tensor) -> Tensor:
    """exp of float64 values, clamped to [-700, 700] (so -inf gives ~1e-304).

    x = k ln2 + r with |r| <= ln2 / 2 (Cody-Waite), exp r by a degree-14
    Taylor polynomial, and 2**k built from its exponent bits.
    """
    x = x.clamp(-700.0, 700.0)
    k = torch.round(x * (1.0 / _LN2))
    r = (x - k * _LN2_HI) - k * _LN2_LO
    poly = torch.full_like(r, _EXP_COEFFS[-1])
    for c in reversed(_EXP_COEFFS[:-1]):
        poly = poly * r + c
    scale = ((k.to(torch.int64) + 1023) << 52).view(torch.float64)
    return poly * scale


# ---------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------


@dataclass
class SamplingParams:
    """Per-row sampling settings, as tensors on the logits' device.

    Tensors (not Python lists) so that a batch's settings travel with it and
    every row is handled by the same vectorised code path.
    """

    temperature: Tensor  # float32 [R]; 0 => greedy (plain argmax)
    top_k: Tensor  # int64 [R]; 0 or >= V => off
    top_p: Tensor  # float32 [R]; 1.0 => off
    min_p: Tensor  # float32 [R]; 0.0 => off
    seed: Tensor  # int64 [R]; any 64-bit value, bits read as uint64

    @classmethod
    def from_lists(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        min_p: Sequence[float],
        seed: Sequence[int],
        device: torch.device | str,
    ) -> "SamplingParams":
        """Validate plain per-row values and move them to ``device``.

        Seeds may be given as signed int64 or as uint64 (>= 2**63); both are
        stored as the int64 with the same bits, so ``s`` and ``s - 2**64``
        sample identically.
        """
        rows = len(temperature)
        if not all(len(v) == rows for v in (top_k, top_p, min_p, seed)):
            raise ValueError("all sampling parameter lists must have one value per row")
        for rule, values in ((TEMPERATURE, temperature), (TOP_K, top_k), (SAMPLER_TOP_P, top_p), (MIN_P, min_p),
                             (SEED, seed)):
            if not all(rule.holds(v) for v in values):
                raise ValueError(f"{rule.name} must be {rule}")
        signed = [s - 2**64 if s >= 2**63 else s for s in seed]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
            seed=torch.tensor(signed, dtype=torch.int64, device=device),
        )

    @classmethod
    def greedy(cls, rows: int, device: torch.device | str) -> "SamplingParams":
        """All rows greedy, all filters off."""
        return cls.from_lists([0.0] * rows, [0] * rows, [1.0] * rows, [0.0] * rows, [0] * rows, device)


# ---------------------------------------------------------------------------
# Noise, filters, sampling
# ---------------------------------------------------------------------------


# Elements per block of the [R, V] noise grid.  The noise takes ~90 elementwise
# ops per element, so on CPU blocks that stay in cache are several times faster
# than whole-grid passes; on GPU large blocks keep launches few while bounding
# the int64/float64 temporaries.  Blocking never changes a value.
_NOISE_BLOCK = {"cpu": 1 << 15, "cuda": 1 << 24}


def gumbel_noise(seed: Tensor, position: Tensor, vocab: int) -> Tensor:
    """Standard Gumbel noise keyed by (seed, position, token id): float32 [R, V].

    u = (h + 0.5) / 2**32 uses all 32 hash bits and is exact in float64, in
    (0, 1) strictly; g = -log(-log u) is computed in float64 with ``_log64``
    (u close to 1 keeps its precision, which is where the largest, deciding
    noise values come from) and rounded once to float32.  The range is about
    [-3.14, 22.9], so only tokens ~26 nats below the best can never win.
    """
    device = seed.device
    state = _row_state(seed, position)
    out = torch.empty((seed.shape[0], vocab), dtype=torch.float32, device=device)
    cols = max(1, _NOISE_BLOCK.get(device.type, 1 << 24) // max(1, seed.shape[0]))
    for start in range(0, vocab, cols):
        tokens = torch.arange(start, min(start + cols, vocab), dtype=torch.int64, device=device)
        out[:, start : start + cols] = _gumbel(_token_hash(state, tokens))
    return out


def _gumbel(h: Tensor) -> Tensor:
    """The noise of hashes h (gumbel_noise's formula)."""
    u = (h.to(torch.float64) + 0.5) * (1.0 / 2**32)
    return (-_log64(-_log64(u))).to(torch.float32)


def _keep_top_k(x: Tensor, k: Tensor, kmax: int) -> Tensor:
    """Mask of the k[r] largest entries of each row, ties broken by lowest id.

    Exactly k[r] entries survive (1 <= k[r] <= kmax <= V; kmax = max(k),
    given by the caller, who knows it without reading the device).  ``topk``
    supplies only the k-th largest *value* (exact); which of the entries
    equal to it survive is decided here by id, since topk's tie order is
    unspecified.
    """
    thr = torch.topk(x, kmax, dim=-1, sorted=True).values.gather(1, (k - 1)[:, None])
    above = x > thr
    need = k[:, None] - above.sum(dim=-1, keepdim=True)
    at = x == thr
    return above | (at & (at.cumsum(dim=-1) <= need))


# top-p weights are fixed point: floor(2**40 * exp(z - zmax)), so sums are
# exact integers (V * 2**40 < 2**63 for V < 2**23) and order-independent, unlike
# a float cumsum, whose CUDA scan rounds in another order than the CPU loop.
# The final comparison is one correctly rounded float64 product.
_TOP_P_SCALE = 2.0**40


def _keep_top_p(z: Tensor, top_p: Tensor) -> Tensor:
    """Mask of the smallest prefix (by z descending, ties by lowest id) whose
    probability mass reaches top_p; always at least one token."""
    z_sorted, order = torch.sort(z, dim=-1, descending=True, stable=True)
    w = _exp64(z_sorted.to(torch.float64) - z_sorted[:, :1].to(torch.float64))
    q = torch.floor(w * _TOP_P_SCALE).to(torch.int64)
    before = q.cumsum(dim=-1) - q  # mass strictly before each token
    total = q.sum(dim=-1, keepdim=True)
    keep_sorted = before.to(torch.float64) < top_p.to(torch.float64)[:, None] * total.to(torch.float64)
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


@dataclass(frozen=True)
class Filters:
    """Which steps any row of a batch needs: a random draw, top-k, top-p, min-p.

    Computed once from the settings.  A caller that holds a host copy of
    device settings passes ``Filters.of(host_copy, vocab)`` to ``sample`` /
    ``filter_logits``, so the device batch is sampled without reading its
    settings back (each such read waits for the GPU to finish its queue).
    Skipping a step no row uses changes nothing: every step keeps all tokens
    of a row where it is off.
    """

    draw: bool
    top_k: int  # the largest k of a row that uses top-k; 0 when none does
    top_p: bool
    min_p: bool

    @classmethod
    def of(cls, params: SamplingParams, vocab: int) -> "Filters":
        k_on = (params.top_k > 0) & (params.top_k < vocab)
        return cls(draw=bool((params.temperature > 0).any()),
                   top_k=int(torch.where(k_on, params.top_k, 0).max()) if params.top_k.numel() else 0,
                   top_p=not bool((params.top_p >= 1.0).all()),
                   min_p=not bool((params.min_p <= 0.0).all()))


def filter_logits(logits: Tensor, params: SamplingParams, filters: Filters | None = None) -> Tensor:
    """z = logits / T with -inf outside each row's kept set: float32 [R, V].

    Filters run in the order top_k, top_p (on the top-k survivors), min_p.
    The best token always survives.  Greedy rows (T = 0) are scaled by 1;
    ``sample`` does not use their filtered values.  ``filters``: see
    ``Filters`` (default: read from ``params``).
    """
    logits = logits.to(torch.float32)
    vocab = logits.shape[-1]
    filters = filters or Filters.of(params, vocab)
    temp = params.temperature.to(torch.float32)
    z = logits / torch.where(temp > 0, temp, torch.ones_like(temp))[:, None]
    neg_inf = float("-inf")  # a Python scalar: a device tensor made from it would be a copy that waits for the GPU

    if filters.top_k:
        k_off = (params.top_k <= 0) | (params.top_k >= vocab)
        k = torch.where(k_off, torch.ones_like(params.top_k), params.top_k)
        z = torch.where(_keep_top_k(z, k, filters.top_k) | k_off[:, None], z, neg_inf)

    if filters.top_p:
        p_off = params.top_p >= 1.0
        z = torch.where(_keep_top_p(z, params.top_p) | p_off[:, None], z, neg_inf)

    # prob_i >= min_p * prob_max  <=>  z_i - z_max >= log(min_p)
    if filters.min_p:
        m_off = params.min_p <= 0.0
        min_p = torch.where(m_off, torch.ones_like(params.min_p), params.min_p).to(torch.float64)
        zmax = z.max(dim=-1, keepdim=True).values
        gap = z.to(torch.float64) - zmax.to(torch.float64)
        keep = (gap >= _log64(min_p)[:, None]) | (z == zmax) | m_off[:, None]
        z = torch.where(keep, z, neg_inf)
    return z


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, mask_index: Tensor) -> Tensor:
    """Logits with -inf wherever a row's grammar mask forbids the token: float32 [R, V].

    ``bitmask`` is int32 [M, W] (bit i of word j allows token 32 j + i, the
    layout llguidance and xgrammar fill); ``mask_index`` int32 [R] names each
    row's mask, -1 = unmasked.  Ids past 32 W are forbidden for masked rows.
    Pure selection, so a row's values do not depend on the other rows.
    """
    logits = logits.to(torch.float32)
    rows, vocab = logits.shape
    if rows == 0 or not bool((mask_index >= 0).any()):  # before the move: a host index is checked on the host
        return logits
    mask_index = to_device(mask_index.to(torch.int64), logits.device)
    words = to_device(bitmask, logits.device).to(torch.int64) & 0xFFFFFFFF  # int32 bits as unsigned
    shifts = torch.arange(32, dtype=torch.int64, device=logits.device)
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(words.shape[0], -1).bool()  # [M, 32 W]
    if allowed.shape[1] < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])], dim=1)
    row_allowed = allowed[mask_index.clamp(min=0), :vocab] | (mask_index < 0)[:, None]
    return torch.where(row_allowed, logits, float("-inf"))


def sample(logits: Tensor, positions: Tensor, params: SamplingParams, filters: Filters | None = None) -> Tensor:
    """Token id per row: int64 [R].

    ``positions`` are the absolute positions of the tokens being chosen (the
    key of the noise).  Greedy rows take argmax of the raw logits; the others
    argmax of filtered z plus keyed Gumbel noise.  Both are computed for every
    row and selected per row, so mixing the two never changes either.
    ``filters``: see ``Filters`` (default: read from ``params``).
    """
    logits = logits.to(torch.float32)
    filters = filters or Filters.of(params, logits.shape[-1])
    greedy_ids = logits.argmax(dim=-1)  # documented: first maximal index
    if not filters.draw:
        return greedy_ids
    sampled = params.temperature > 0
    z = filter_logits(logits, params, filters)
    return torch.where(sampled, noisy_argmax(z, params.seed, positions), greedy_ids)


# On the CPU, rows whose filters (a grammar's mask, top-k) leave at most this share of the vocabulary get noise only
# where a token can still win: the noise is ~90 float64 ops a token, most of a constrained CPU step's time.
_SPARSE_SHARE = 1 / 16


def noisy_argmax(z: Tensor, seed: Tensor, position: Tensor) -> Tensor:
    """argmax(z + keyed Gumbel noise) per row (ties -> lowest id), z the filtered logits (-inf: filtered out). The
    same ids whether the noise is drawn for the whole vocabulary or only for the finite entries: a filtered token
    is -inf either way, and a finite one gets the same noise value (elementwise, keyed by its id)."""
    finite = torch.isfinite(z)
    if z.device.type != "cpu" or int(finite.sum()) > _SPARSE_SHARE * z.numel():  # on a GPU: no host sync
        return (z + gumbel_noise(seed, position, z.shape[-1])).argmax(dim=-1)
    rows, ids = finite.nonzero(as_tuple=True)
    scores = torch.full_like(z, float("-inf"))
    scores[rows, ids] = z[rows, ids] + _gumbel(_pair_hash(_row_state(seed, position)[rows], ids))
    return scores.argmax(dim=-1)


def token_logprobs(logits: Tensor, token_ids: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """log_softmax of ``logits`` (raw logits: vLLM's raw logprobs; the output
    of ``filter_logits``: the sampler's distribution, see
    ``processed_logprobs``) at the chosen tokens and each row's k most likely.

    Returns (chosen [R] float32, top_ids [R, k] int64, top_logprobs [R, k]
    float32), top entries by logprob descending, ties by lowest id.
    """
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    chosen = logprobs.gather(1, token_ids.to(torch.int64)[:, None]).squeeze(1)
    top_ids, top = _top_logprobs(logprobs, k)
    return chosen, top_ids, top


def _top_logprobs(logprobs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Each row's k largest logprobs and their ids ([R, k] int64 / float32), by logprob descending, ties by lowest
    id."""
    rows, vocab = logprobs.shape
    if not 0 <= k <= vocab:
        raise ValueError(f"k must be in [0, {vocab}]")
    if k == 0:
        empty = logprobs.new_empty((rows, 0))
        return empty.to(torch.int64), empty
    keep = _keep_top_k(logprobs, torch.full((rows,), k, dtype=torch.int64, device=logprobs.device), k)
    ids = keep.nonzero()[:, 1].view(rows, k)  # ascending id within each row
    top, order = torch.sort(logprobs.gather(1, ids), dim=-1, descending=True, stable=True)
    return ids.gather(1, order), top


# Rows of logits scored at a time by `prompt_logprobs`: its temporaries (the log-softmax and a comparison mask) stay
# this many rows of the vocabulary, however long the prefill chunk. Row-wise ops: blocking changes no value.
_SCORE_BLOCK = 256


def prompt_logprobs(logits: Tensor, next_ids: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Prompt logprobs (vLLM's): the model's raw distribution at each row, log_softmax of the fp32 logits with no
    temperature, filter or mask, scored against the prompt token that follows the row.

    Returns (logprob of next_ids [S] float32, its rank [S] int64 = how many ids have a logprob >= its own, as vLLM
    counts it, top_ids [S, k] int64, top_logprobs [S, k] float32 by logprob descending, ties by lowest id). The
    log-softmax is `token_logprobs`' (one row at a time, the same call), computed `_SCORE_BLOCK` rows at a time.
    """
    rows = logits.shape[0]
    chosen, ranks, top_ids, top = [], [], [], []
    for a in range(0, rows, _SCORE_BLOCK):
        logprobs = torch.log_softmax(logits[a : a + _SCORE_BLOCK].to(torch.float32), dim=-1)
        c = logprobs.gather(1, next_ids[a : a + _SCORE_BLOCK].to(torch.int64)[:, None])
        chosen.append(c.squeeze(1))
        ranks.append((logprobs >= c).sum(dim=-1))
        i, v = _top_logprobs(logprobs, k)
        top_ids.append(i)
        top.append(v)
    if not rows:
        empty = logits.new_empty((0,), dtype=torch.float32)
        i, v = _top_logprobs(logits.new_empty((0, logits.shape[-1]), dtype=torch.float32), k)
        return empty, empty.to(torch.int64), i, v
    return torch.cat(chosen), torch.cat(ranks), torch.cat(top_ids), torch.cat(top)


def processed_logprobs(logits: Tensor, params: SamplingParams, token_ids: Tensor, k: int,
                       filters: Filters | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Logprobs of the distribution the keyed draw samples from.

    The distribution of a row is  softmax(filter_logits(logits, params)):  the
    fp32 logits (after any grammar mask), divided by the temperature, with
    -inf outside the top-k / top-p / min-p kept set.  Gumbel-max over those z
    draws exactly from it, so these are the true probabilities of what
    ``sample`` picks.  Greedy rows (T = 0) are reported at T = 1 with the same
    filters (their draw is the argmax, which always has the largest logprob).
    Tokens outside the kept set get -inf.  Same return as ``token_logprobs``.
    """
    return token_logprobs(filter_logits(logits, params, filters), token_ids, k)
