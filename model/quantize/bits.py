"""EXL3 bits per weight for each linear from a target average (`exl3:BITS`): twinspark's rule, shaped like
exllamav3's converter (which starts every tensor at the supported rate at or below the target and promotes whole
groups one step, in priority order, while the bit budget lasts), but with no measured error: it depends only on
the linears' keys and sizes, so quantize, make-tiny and random weights give the same linears the same rates.

Rates: 1..8 bits, and 1.5 / 2.5 / 3.5 with the mul1 codebook (exllamav3 1.6.5 has kernels for those; twinspark's
decode and GPU tile read them). With lo the largest rate <= the target and hi the next:
1. A target that is a rate gives every linear that rate (exl3:2.5 with mul1: all 2.5; exl3:3.0: all 3).
2. Otherwise every group starts at lo and groups are promoted to hi one by one, each only while the average over
   all the EXL3 linears (weighted by their element counts) stays at or under the target, in this order: attention
   first, then shared experts, dense MLPs and other linears, then routed experts (read for 2 of E experts per
   token, so their error reaches fewer outputs); within a role, layers nearer either end of the stack first (their
   error reaches the output most directly, as exllamav3 also ranks), then lower layer index, then key.
A group is what must share a rate: all routed experts of a layer (the fused MoE kernels stack them into one
tensor), else one layer's linears of one role (its attention, its shared expert, its dense MLP), else one linear.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kernels.quant import exl3
from model.quantize.select import ROUTED_EXPERTS, check_exl3_bits

_LAYER = re.compile(r"\.layers\.(\d+)\.")
_ROLES = ((".self_attn.", "attention", 0), (ROUTED_EXPERTS, "experts", 2), (".mlp.shared_experts.", "shared", 1),
          (".mlp.", "mlp", 1))


@dataclass(frozen=True)
class BitPlan:
    bits: dict[str, float]  # weight key -> its EXL3 bits per weight
    average: float  # over the planned linears, weighted by element count

    def summary(self) -> str:
        """E.g. "12 linears at 3, 8 at 3.5: 3.21 bits per weight on average"."""
        counts: dict[float, int] = {}
        for b in self.bits.values():
            counts[b] = counts.get(b, 0) + 1
        parts = [f"{n} {'linears ' if i == 0 else ''}at {b:g}" for i, (b, n) in enumerate(sorted(counts.items()))]
        return f"{', '.join(parts)}: {self.average:.2f} bits per weight on average"


def rates(codebook: str) -> tuple[float, ...]:
    """Every EXL3 rate with kernels for this codebook, ascending."""
    return tuple(sorted({*range(1, 9), *(exl3.HALF_BITS if codebook == "mul1" else ())}))


def plan(linears: dict[str, int], target: float, codebook: str) -> BitPlan:
    """linears: weight key -> element count of every linear stored as EXL3."""
    exl3.check_rate(1, codebook)  # a known codebook
    check_exl3_bits(target, f"{target:g}: ")
    ladder = rates(codebook)
    lo = max(r for r in ladder if r <= target)
    hi = next((r for r in ladder if r > lo), lo)
    bits = dict.fromkeys(linears, lo)
    total = sum(linears.values())
    if lo != target and total:
        budget = target * total
        used = lo * total
        for keys in _promotion_order(linears):
            extra = (hi - lo) * sum(linears[k] for k in keys)
            if used + extra <= budget * (1 + 1e-12):
                bits.update(dict.fromkeys(keys, hi))
                used += extra
    average = sum(bits[k] * n for k, n in linears.items()) / total if total else 0.0
    return BitPlan({k: _as_rate(b) for k, b in bits.items()}, average)


def _as_rate(b: float) -> float:
    """2.0 -> 2 (the trellis' width is 16 * bits words: exllamav3 writes whole rates as ints)."""
    return int(b) if float(b).is_integer() else b


def _promotion_order(linears: dict[str, int]) -> list[list[str]]:
    """The groups (see the module note), in the order they are promoted."""
    groups: dict[tuple[int, int, str], list[str]] = {}
    for key in sorted(linears):
        m = _LAYER.search(key)
        layer = int(m.group(1)) if m else -1
        role, rank = next(((name, r) for part, name, r in _ROLES if part in key), (key, 1))
        groups.setdefault((rank, layer, role if m else key), []).append(key)
    last = max((layer for _, layer, _ in groups), default=-1)

    def order(g: tuple[int, int, str]) -> tuple[int, int, int, str]:
        rank, layer, role = g
        end_distance = min(layer, last - layer) if layer >= 0 else 0
        return rank, end_distance, layer, role

    return [groups[g] for g in sorted(groups, key=order)]
