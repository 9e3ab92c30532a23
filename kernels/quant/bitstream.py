"""Unsigned codes of `bits` bits packed along a row into int32 words as one little-endian bit stream: element i of a
row occupies stream bits [i * bits, (i + 1) * bits), word j holds stream bits [32 j, 32 j + 32), lowest bit first.
With bits = 3 an element may straddle two words. The int formats (intn.py: 2, 3, 4 and 8 bits) and W4A16 (w4a16.py:
4 bits, 8 nibbles a word, lowest first, which is the same stream) store their codes this way.

A row is cut into periods: the fewest elements that fill whole words (32 elements in 3 words for 3 bits, 8 in one
word for 4). Every period has the same layout, so packing and unpacking index one period's (word, shift) table.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

WORD = 32
_MASK32 = 0xFFFFFFFF


def period(bits: int) -> tuple[int, int]:
    """(elements, words) of one period: the fewest whole elements that fill whole words."""
    g = math.gcd(bits, WORD)
    return WORD // g, bits // g


def _layout(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each element of a period: the word its lowest bit is in, and that bit's position in the word."""
    first_bit = torch.arange(period(bits)[0], dtype=torch.int64, device=device) * bits
    return first_bit // WORD, first_bit % WORD


def _check(n: int, per: int, what: str, bits: int) -> None:
    if n % per:
        raise ValueError(f"{bits}-bit codes fill whole int32 words only {per} {what} at a time; a row of {n} {what} "
                         f"is not a multiple of {per}")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes in [0, 2^bits), [rows, n] -> int32 [rows, n * bits / 32] (n a multiple of the period's elements)."""
    rows, n = codes.shape
    elements, words = period(bits)
    _check(n, elements, "elements", bits)
    c = codes.to(torch.int64).view(rows, n // elements, elements)
    word, shift = _layout(bits, codes.device)
    low = (c << shift) & _MASK32
    high = c >> (WORD - shift)  # the bits that run into the next word: zero unless the element straddles
    # The elements' bit ranges are disjoint, so adding them up is OR-ing them; the extra last word stays zero
    # because a period ends on a word boundary.
    out = torch.zeros(rows, n // elements, words + 1, dtype=torch.int64, device=codes.device)
    out.index_add_(2, word, low).index_add_(2, word + 1, high)
    out = out[..., :words].reshape(rows, -1)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)  # the same 32 bits, as int32


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [rows, m] -> int64 codes in [0, 2^bits), [rows, m * 32 / bits] (m a multiple of the period's words)."""
    rows, m = packed.shape
    elements, words = period(bits)
    _check(m, words, "words", bits)
    w = (packed.to(torch.int64) & _MASK32).view(rows, m // words, words)
    w = F.pad(w, (0, 1))  # a zero word after each period: the "next word" of its last element
    word, shift = _layout(bits, packed.device)
    # An element's high part shifted up by 32 - shift lands at or above `bits` unless it straddles: masked away.
    codes = ((w[..., word] >> shift) | (w[..., word + 1] << (WORD - shift))) & ((1 << bits) - 1)
    return codes.reshape(rows, -1)


def random_words(rows: int, n: int, bits: int, *, generator: torch.Generator | None = None,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """The packed words of [rows, n] random codes: random bytes, since every bit pattern is a valid stream (codes
    uniform over [0, 2^bits)). Drawn on `device`."""
    _check(n, period(bits)[0], "elements", bits)
    return torch.randint(0, 256, (rows, n * bits // 8), dtype=torch.uint8, generator=generator,
                         device=device).view(torch.int32)
